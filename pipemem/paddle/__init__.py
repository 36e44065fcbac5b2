"""Paddle static programs as a source of pipemem programs (DESIGN.md, "Sources of programs").

* `split`   - cut a Paddle main program into forward / backward / optimizer sub-programs
              by each op's ``op_role`` attribute, the way Paddle's pipeline passes do,
              and optionally the backward into backward_b / backward_w (zero bubble);
* `capture` - map (sub-)programs to pipemem IR: concrete shapes, real dtype sizes,
              persistables as static bytes, in-place outputs and no_need_buffer inputs;
* `measure` - run the sub-programs in sequence with Paddle's executor on the CPU and read
              the host allocator's statistics before and after each one;
* `compare` - pipemem, Paddle's own `PipelineMemoryEstimator` and the measurement side by
              side (`pipemem validate paddle`);
* `models`  - the small static programs the comparison runs (MLP, GPT / Llama decoders);
* `worker`  - ``python -m pipemem.paddle.worker [--ir pir] [CASE ...]``: the comparison as JSON.

The modules above take legacy `Program`s (``FLAGS_enable_pir_api=0`` before paddle is
imported). PIR programs (Paddle 3's default IR) have their own:

* `pir_capture` - a PIR program -> pipemem IR, split into forward / backward / optimizer
                  (by op_role when set, else by structure), with the executor's in-place
                  pass, CPU views and no_need_buffer operands;
* `pir_measure` - a whole step's peak and net with Paddle's normal `Executor` (PIR has no
                  py_func to measure between sub-programs);
* `pir_models`  - the same models built as PIR programs.

Everything here imports paddle inside functions: importing `pipemem.paddle` stays cheap.
Paddle work for the CLI and the tests runs in a subprocess (`python -m
pipemem.paddle.worker`), so Paddle and PyTorch never share a process.
"""
