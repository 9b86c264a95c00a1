"""d3d: a standalone block-diffusion drafter for asynchronous speculative decoding.

Pipeline modules: d3d.data (prompts, benchmarks), d3d.models (target resolution, drafter),
d3d.generate (target responses). Jobs run as `python -m d3d.<job>` with Hydra configs from conf/.
"""

__version__ = "0.1.0"
