"""Paddle static programs as a source of pipemem programs (DESIGN.md, "Sources of programs").

* `split`       - cut a Paddle main program into forward / backward / optimizer sub-programs
                  by each op's ``op_role`` attribute, the way Paddle's pipeline passes do,
                  and optionally the backward into backward_b / backward_w (zero bubble);
* `capture`     - map legacy (sub-)programs to pipemem IR: concrete shapes, real dtype sizes,
                  persistables as static bytes, in-place outputs and no_need_buffer inputs
                  (``FLAGS_enable_pir_api=0`` before paddle is imported);
* `pir_capture` - a PIR program (Paddle 3's default IR) -> pipemem IR, split into forward /
                  backward / optimizer (by op_role when set, else by structure), with the
                  executor's in-place pass, CPU views and no_need_buffer operands.

The measurements and the comparison with Paddle's own estimator are validation, in
`pipemem.validation.paddle_runs`. Everything here imports paddle inside functions:
importing `pipemem.paddle` stays cheap.
"""
