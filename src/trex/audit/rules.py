"""The audit's rule table and the vendor names it looks for.

This file is data: every vendor-specific string the audit knows lives here (or in the other
modules of this package), which is why the project's own audit config allowlists the package.

Rule ids: TRX1xx device API, TRX2xx collectives, TRX3xx kernels and libraries, TRX4xx custom
extensions, TRX5xx packaging.
"""

from __future__ import annotations

import re

from trex.audit.model import Effort, Rule, Severity

E, W, I = Severity.ERROR, Severity.WARNING, Severity.INFO
MECH, MOD, REW = Effort.MECHANICAL, Effort.MODERATE, Effort.REWRITE

DEVICE, COLLECTIVES, KERNELS, EXTENSIONS, PACKAGING = (
    "device-api", "collectives", "kernels", "extensions", "packaging")
CATEGORIES = (DEVICE, COLLECTIVES, KERNELS, EXTENSIONS, PACKAGING)

_RULES = [
    # ---- device API ---------------------------------------------------------------------
    Rule("TRX100", "cuda-availability-guard", DEVICE, I, MECH,
         "a CUDA availability check that guards a fallback",
         "torch.accelerator.is_available(); the guarded branch is skipped on other accelerators"),
    Rule("TRX101", "cuda-call-portable", DEVICE, E, MECH,
         "torch.cuda.* call with a torch.accelerator equivalent",
         "the torch.accelerator function of the same purpose"),
    Rule("TRX102", "cuda-call", DEVICE, E, MOD,
         "torch.cuda.* call without a torch.accelerator equivalent",
         "torch.get_device_module(device.type).<same name> (torch_npu mirrors most of torch.cuda as torch.npu)"),
    Rule("TRX103", "cuda-method", DEVICE, E, MECH,
         ".cuda() on a tensor or module", ".to(device) with a device chosen at start-up"),
    Rule("TRX104", "cuda-device-string", DEVICE, E, MECH,
         "a hard-coded CUDA device string", "a device object or name from one device-selection helper"),
    Rule("TRX105", "integer-device-id", DEVICE, E, MECH,
         "an integer device id passed to a tensor factory, .to() or torch.device",
         "a device name such as f'{device_type}:{index}' (integers route to CUDA on some stacks)"),
    Rule("TRX106", "backend-flags", DEVICE, W, MECH,
         "torch.backends.cudnn / torch.backends.cuda flags",
         "set them only when device.type is 'cuda'; Ascend has its own switches (torch.npu.config)"),
    Rule("TRX107", "cuda-amp", DEVICE, E, MECH,
         "torch.cuda.amp or autocast / GradScaler tied to CUDA",
         "torch.amp.autocast(device_type=device.type) and torch.amp.GradScaler(device.type)"),
    Rule("TRX108", "cuda-graphs", DEVICE, E, MOD,
         "CUDA graph capture", "torch.compile, or the device's graph mode (torch.npu.NPUGraph on Ascend)"),
    Rule("TRX109", "nvtx", DEVICE, W, MECH,
         "NVTX ranges", "torch.profiler.record_function (works on every device)"),
    Rule("TRX110", "cuda-stream-event", DEVICE, E, MECH,
         "torch.cuda.Stream / Event / stream context",
         "torch.Stream(device) / torch.Event(device) and torch.accelerator.current_stream()"),
    Rule("TRX111", "cuda-or-cpu", DEVICE, W, MECH,
         "a device chosen as CUDA, or else the CPU: on an Ascend (or any other accelerator) machine it trains on "
         "the CPU without a word",
         'torch.accelerator.current_accelerator() or torch.device("cpu") (the device the machine has)'),
    Rule("TRX112", "cuda-visible-devices", DEVICE, W, MECH,
         "CUDA_VISIBLE_DEVICES selects devices on CUDA only",
         "the device runtime's own variable (ASCEND_RT_VISIBLE_DEVICES on Ascend), or torchrun's LOCAL_RANK with "
         "torch.accelerator.set_device_index"),
    # ---- collectives --------------------------------------------------------------------
    Rule("TRX201", "nccl-backend", COLLECTIVES, E, MECH,
         "the NCCL process-group backend named in code",
         "the default backend of the device type: dist.get_default_backend_for_device(device.type) "
         "(hccl on Ascend), or init_process_group() with no backend"),
    Rule("TRX202", "nccl-env", COLLECTIVES, W, MECH,
         "NCCL_* environment variables",
         "the HCCL_* equivalent on Ascend (HCCL_CONNECT_TIMEOUT, HCCL_BUFFSIZE, HCCL_DETERMINISTIC ...), set per backend"),
    Rule("TRX203", "nccl-only-class", COLLECTIVES, E, MOD,
         "NCCL-only communicator classes and options",
         "torch.distributed collectives on a process group of the device's backend"),
    # ---- kernels and libraries ------------------------------------------------------------
    Rule("TRX301", "cuda-library", KERNELS, E, MOD,
         "import of a CUDA-only kernel library", "see the per-library replacement"),
    Rule("TRX302", "triton-kernel", KERNELS, E, REW,
         "a @triton.jit / @triton.autotune kernel",
         "a reference PyTorch implementation next to it; triton-ascend or an Ascend C kernel for speed"),
    Rule("TRX303", "forced-attention-backend", KERNELS, E, MECH,
         "attention forced to a FlashAttention / cuDNN / mem-efficient backend",
         "attn_implementation='sdpa' or 'eager', and no backend pinning (torch_npu.npu_fusion_attention on Ascend)"),
    Rule("TRX304", "deepspeed-op-builder", KERNELS, E, MOD,
         "DeepSpeed CUDA op builders",
         "get_accelerator().create_op_builder(...) so that DeepSpeed picks the device's builder"),
    # ---- custom extensions -----------------------------------------------------------------
    Rule("TRX401", "cuda-extension", EXTENSIONS, E, REW,
         "a CUDAExtension build", "a CppExtension with a PyTorch fallback, and an Ascend C (or triton-ascend) port"),
    Rule("TRX402", "cuda-jit-extension", EXTENSIONS, E, REW,
         "load_inline / load with CUDA sources", "a PyTorch reference path; port the kernel for Ascend"),
    Rule("TRX403", "cuda-source-file", EXTENSIONS, E, REW,
         ".cu / .cuh source files", "port to Ascend C or triton-ascend, keep a PyTorch reference"),
    # ---- packaging ---------------------------------------------------------------------------
    Rule("TRX501", "nvidia-package", PACKAGING, E, MECH,
         "nvidia-* runtime wheels", "drop them; the accelerator build of torch brings its runtime"),
    Rule("TRX502", "cuda-python-package", PACKAGING, E, MOD,
         "CUDA Python bindings (cuda-python, pycuda, cupy-cuda*)", "torch tensors and device modules"),
    Rule("TRX503", "cuda-wheel", PACKAGING, E, MECH,
         "+cuXXX wheels and CUDA wheel indexes",
         "an unsuffixed torch pin plus the accelerator's own build (torch + torch_npu on Ascend)"),
    Rule("TRX504", "cuda-only-requirement", PACKAGING, E, MOD,
         "a CUDA-only library in the requirements", "see the per-library replacement"),
    Rule("TRX505", "cuda-base-image", PACKAGING, W, MECH,
         "a CUDA container base image", "a per-accelerator base image (an Ascend CANN image for NPUs)"),
]

RULES: dict[str, Rule] = {r.id: r for r in _RULES}

# ---- device API tables ------------------------------------------------------------------------
CUDA_MODULE = "torch.cuda"

# torch.cuda functions and the torch.accelerator (or device-generic) call that replaces them.
CUDA_ACCELERATOR_EQUIVALENTS = {
    "is_available": "torch.accelerator.is_available()",
    "device_count": "torch.accelerator.device_count()",
    "current_device": "torch.accelerator.current_device_index()",
    "set_device": "torch.accelerator.set_device_index(index)",
    "device": "torch.accelerator.device_index(index)",
    "synchronize": "torch.accelerator.synchronize()",
    "current_stream": "torch.accelerator.current_stream()",
    "set_stream": "torch.accelerator.set_stream(stream)",
    "empty_cache": "torch.accelerator.empty_cache()",
    "memory_allocated": "torch.accelerator.memory_allocated()",
    "max_memory_allocated": "torch.accelerator.max_memory_allocated()",
    "memory_reserved": "torch.accelerator.memory_reserved()",
    "max_memory_reserved": "torch.accelerator.max_memory_reserved()",
    "memory_stats": "torch.accelerator.memory_stats()",
    "reset_peak_memory_stats": "torch.accelerator.reset_peak_memory_stats()",
    "reset_accumulated_memory_stats": "torch.accelerator.reset_accumulated_memory_stats()",
    "mem_get_info": "torch.accelerator.get_memory_info()",
    "get_device_capability": "torch.accelerator.get_device_capability()",
    "manual_seed": "torch.manual_seed(seed) (seeds every device)",
    "manual_seed_all": "torch.manual_seed(seed) (seeds every device)",
}

# Sub-namespaces of torch.cuda that have their own rule: (prefix after "torch.cuda.", rule id, replacement).
CUDA_SUBAREAS = [
    ("amp", "TRX107", "torch.amp.autocast(device_type=device.type) / torch.amp.GradScaler(device.type)"),
    ("nvtx", "TRX109", "torch.profiler.record_function(name)"),
    ("CUDAGraph", "TRX108", "torch.compile, or torch.npu.NPUGraph on Ascend"),
    ("graph", "TRX108", "torch.compile, or torch.npu.graph on Ascend"),
    ("graphs", "TRX108", "torch.compile, or the device's graph mode"),
    ("make_graphed_callables", "TRX108", "torch.compile"),
    ("Stream", "TRX110", "torch.Stream(device=device)"),
    ("Event", "TRX110", "torch.Event(device=device)"),
    ("stream", "TRX110", "torch.accelerator.set_stream(...) or the device module's stream context"),
    ("ExternalStream", "TRX110", "the device module's ExternalStream"),
    ("nccl", "TRX203", "torch.distributed collectives"),
]

BACKEND_FLAG_MODULES = ("torch.backends.cudnn", "torch.backends.cuda")
# torch.backends.cuda functions that pin scaled-dot-product attention to a backend.
SDPA_PINNING = {"enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp", "sdp_kernel",
                "enable_math_sdp"}
FORCED_SDPA_BACKENDS = {"FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"}
FLASH_ATTN_IMPLEMENTATIONS = {"flash_attention_2", "flash_attention_3", "flash_attention", "kernels-community/flash-attn"}
FLASH_FLAGS = {"use_flash_attention_2", "use_flash_attn", "use_flash_attention"}

AMP_NAMES = {"autocast", "GradScaler"}
DEVICE_STRING = re.compile(r"cuda(:\d+)?")
DEVICE_PREFIX = "cuda:"  # f"cuda:{rank}"
GUARD_DEVICE_TYPE = "cuda"  # `device.type == "cuda"` guards a branch
DEVICE_TYPES = {"cuda", "npu", "xpu", "cpu", "mps", "hpu", "mtia", "meta"}
# Names that hold an integer device index when passed as device=... or .to(...).
RANK_NAMES = {"local_rank", "rank", "gpu", "gpu_id", "gpu_idx", "device_id", "cuda_id", "LOCAL_RANK"}

# ---- collectives ----------------------------------------------------------------------------------
NCCL = "nccl"
NCCL_ENV = re.compile(r"NCCL_[A-Z0-9_]+")
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
VISIBLE_DEVICES_IN_TEXT = re.compile(r"\bCUDA_VISIBLE_DEVICES\b")
# pip/uv/conda install commands in shell scripts and Dockerfiles: what follows are requirements
PIP_INSTALL = re.compile(r"\b(?:pip3?|uv pip|python3? -m pip|conda|mamba)\s+install\s+(?P<args>.*)")
NCCL_ENV_IN_TEXT = re.compile(r"\b(NCCL_[A-Z0-9_]+)\s*=")  # shell and Dockerfile assignments
NCCL_ONLY_NAMES = {"PyNcclCommunicator", "ProcessGroupNCCL", "NCCLConfig", "NcclCommunicator", "pynccl",
                   "CudaCommunicator"}

# ---- kernel libraries ------------------------------------------------------------------------------
# Top-level import name -> (requirement names, effort, replacement).
CUDA_LIBRARIES: dict[str, tuple[tuple[str, ...], Effort, str]] = {
    "flash_attn": (("flash-attn",), MOD,
                   "torch.nn.functional.scaled_dot_product_attention; torch_npu.npu_fusion_attention on Ascend"),
    "flash_attn_interface": (("flash-attn-3",), MOD, "torch.nn.functional.scaled_dot_product_attention"),
    "xformers": (("xformers",), MOD, "torch.nn.functional.scaled_dot_product_attention"),
    "apex": (("apex",), MOD,
             "torch.optim.AdamW(fused=...) / torch.nn.RMSNorm / torch.amp; MindSpeed fused ops on Ascend"),
    "transformer_engine": (("transformer-engine", "transformer-engine-torch"), REW,
                           "plain torch modules with a precision policy; torchao for fp8 where supported"),
    "deep_ep": (("deep-ep",), REW, "torch.distributed.all_to_all_single dispatch/combine; MindSpeed MoE dispatcher on Ascend"),
    "deep_gemm": (("deep-gemm",), REW, "torch grouped matmul (torch._grouped_mm); torch_npu.npu_grouped_matmul on Ascend"),
    "bitsandbytes": (("bitsandbytes",), MOD, "torchao quantization or full-precision optimizer states"),
    "triton": (("triton", "pytorch-triton"), REW, "a PyTorch reference implementation; triton-ascend on Ascend"),
    "cupy": (("cupy",), MOD, "torch tensor operations (or numpy on the host)"),
    "pynvml": (("pynvml", "nvidia-ml-py", "nvidia-ml-py3"), MECH,
               "torch.accelerator memory queries; device.environment_report() for inventory"),
    "liger_kernel": (("liger-kernel",), MOD, "the unfused torch ops (or the device's fused kernels)"),
    "mamba_ssm": (("mamba-ssm",), REW, "a PyTorch reference selective scan"),
    "causal_conv1d": (("causal-conv1d",), MOD, "torch.nn.functional.conv1d with left padding"),
    "pycuda": (("pycuda",), REW, "torch device modules and kernels"),
    "nvtx": (("nvtx",), MECH, "torch.profiler.record_function"),
}
IMPORT_FUNCS = {"import_module", "__import__"}
# DeepSpeed: CUDA op builders and the fused ops they compile.
DEEPSPEED_OP_MODULE = "deepspeed.ops.op_builder"
DEEPSPEED_CUDA_BUILDER = re.compile(r"\w*(CUDAOpBuilder|Builder)$")
TRITON_DECORATORS = {"triton.jit", "triton.autotune", "triton.heuristics"}

# ---- custom extensions -------------------------------------------------------------------------------
CPP_EXTENSION_MODULE = "torch.utils.cpp_extension"
CUDA_EXTENSION_NAMES = {"CUDAExtension"}
JIT_LOADERS = {"load", "load_inline"}
CUDA_SOURCE_SUFFIXES = (".cu", ".cuh")

# ---- packaging ---------------------------------------------------------------------------------------
NVIDIA_PACKAGE = re.compile(r"nvidia-[a-z0-9-]+")
CUDA_PYTHON_PACKAGES = re.compile(r"(cuda-python|cuda-bindings|pycuda|cupy-cuda[a-z0-9]*)")
CUDA_LOCAL_VERSION = re.compile(r"\+cu\d{2,3}\b")
CUDA_WHEEL_INDEX = re.compile(r"download\.pytorch\.org/whl/(nightly/)?cu\d{2,3}")
CUDA_BASE_IMAGE = re.compile(r"^\s*FROM\s+(\S*nvidia/cuda\S*|\S*nvcr\.io/\S+)", re.IGNORECASE)
# Requirement name -> import name, derived from CUDA_LIBRARIES (pycuda and cupy-cuda* are TRX502).
CUDA_ONLY_REQUIREMENTS: dict[str, str] = {
    req: module
    for module, (reqs, _, _) in CUDA_LIBRARIES.items()
    if module not in ("pycuda",)
    for req in reqs
}
