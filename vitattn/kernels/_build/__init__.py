"""Build-time tools for the Triton kernels (ahead-of-time compilation for GPUs this machine may not
have). Nothing in the runtime package imports this subpackage; CI and ``benchmarks/gpu_check.sh``
run it as ``python -m vitattn.kernels._build.aot``."""
