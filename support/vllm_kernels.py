"""vLLM's CPU build made to pick kernels it would refuse on this CPU, for the tests'
vLLM worker (``tests/engines/vllm_worker.py``) and ``benchmarks/vllm_bench.py``'s quantized
models: their models are created and loaded, never served."""

from __future__ import annotations

from typing import Any

__all__ = ["select_kernels_without_running_them"]


def select_kernels_without_running_them() -> None:
    """Let vLLM's CPU build pick kernels for the quantized formats it has none for on this
    CPU, so that their models can be created and loaded (and their bytes compared) where
    serving them is impossible: block-wise FP8's linear kernel and the CPU experts for
    MXFP4, int4 and int8 need AMX (the int4 experts also take only symmetric weights in
    groups other than 32), NVFP4 has no CPU kernel (its pure-torch emulation kernel is
    registered for the CPU, through vLLM's own hook; its experts' device check is skipped).
    Each patch answers only "is this kernel eligible here": a quantization method's
    parameters, their shapes, dtypes and loaders, come from the checkpoint's scheme, never
    from the kernel; ``create_weights`` builds the chosen kernel's object without running
    it, and nothing runs it before ``process_weights_after_loading``, after the bytes of
    ``load_weights`` are taken."""
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.model_executor.kernels.linear.scaled_mm import cpu
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe, nvfp4_emulation_moe
    from vllm.platforms.interface import PlatformEnum

    def eligible(*_: Any) -> tuple[bool, None]:
        return True, None

    def anywhere() -> bool:
        return True

    def any_scheme(*_: Any) -> bool:
        return True

    cpu.CPUFp8BlockScaledMMKernel.is_supported = classmethod(eligible)  # type: ignore[assignment]
    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    for experts in (
        cpu_moe.CPUExpertsMxfp4,
        cpu_moe.CPUExpertsInt4,
        cpu_moe.CPUExpertsInt8,
        nvfp4_emulation_moe.Nvfp4QuantizationEmulationTritonExperts,
    ):
        experts._supports_current_device = staticmethod(anywhere)  # type: ignore[method-assign]
    cpu_moe.CPUExpertsInt4._supports_quant_scheme = staticmethod(any_scheme)  # type: ignore[method-assign]
