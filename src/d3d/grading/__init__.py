"""Task-level checks: is an answer right? Used to show losslessness at the task level (docs/design.md, Evaluation).

At T = 0 a lossless method returns the AR tokens, so its verdicts must equal AR's; a verdict that
differs is a bug even if the token comparison were somehow fooled. Cheap checks only, one module a job:
- `answers`: what a reply answers (a math answer, a code block) and the program a code benchmark's
  record makes of it (answer, tests);
- `sandbox`: where graded code runs (bubblewrap, a seccomp filter, the tree's budget) and the refusal
  where it cannot;
- `verdict`: the harness that runs answer and tests, how the tests' checks are kept out of the
  answer's reach, and `grade`, the one entry point.
Other benchmarks (MT-Bench, LiveCodeBench, Alpaca) get `None`: no cheap reference check exists.
"""
