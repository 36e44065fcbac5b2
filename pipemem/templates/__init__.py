"""Template mode: op-level programs of one rank's share of a transformer under a parallel plan.

layers.py generates the parts (embedding, decoder layer, head) as autograd nodes on a tape
(tape.py), which writes forward / backward / split-backward IR programs; programs.py runs the
liveness engine on them (cached per distinct shape); static.py counts parameters, gradients
and optimizer states per rank; conventions.py holds what differs between frameworks.
"""
