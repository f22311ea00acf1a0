"""Real chat templates and the real Qwen2.5 tokenizer, shipped inside the repo (``tests/data``).

The tokenizer's 18 MB ``tokenizer.json`` is committed xz-compressed (1.9 MB) and unpacked once per
machine into a cache folder keyed by its checksum; see ``tests/data/tokenizers/README.md`` for how
it was made and ``tests/data/chat_templates/SOURCES.md`` for where each template comes from.
"""

import hashlib
import lzma
import shutil
from pathlib import Path

import agent_loop.files as files
from masking.cache import cache_root

DATA = Path(__file__).resolve().parents[1] / "data"
TEMPLATES_DIR = DATA / "chat_templates"
TEMPLATE_FILES = sorted(p.name for p in TEMPLATES_DIR.glob("*.jinja"))
_QWEN_SRC = DATA / "tokenizers" / "qwen2.5"
QWEN_TOKENIZER_SHA256 = "4ae6f3b5abec7cde919b896583cf45430dd2979412d5ad3198f456ac6afa568e"


def read_template(name: str) -> str:
    return (TEMPLATES_DIR / name).read_text()


def qwen_tokenizer_dir() -> Path:
    """A folder that ``AutoTokenizer.from_pretrained`` loads as the real Qwen2.5 tokenizer (unpacked once, under
    the build lock, written whole: ``agent_loop.files``)."""
    target = cache_root() / f"test-tokenizer-qwen2.5-{QWEN_TOKENIZER_SHA256[:12]}"
    if (target / "tokenizer.json").is_file():
        return target
    from agent_loop.tiny.build import build_lock  # loads torch: only on the machine's first unpack

    with build_lock(target):
        if not (target / "tokenizer.json").is_file():  # another process (an xdist worker) may have unpacked it
            files.write_folder(target, _unpack_qwen)
    return target


def _unpack_qwen(folder: Path) -> None:
    raw = lzma.decompress((_QWEN_SRC / "tokenizer.json.xz").read_bytes())
    if hashlib.sha256(raw).hexdigest() != QWEN_TOKENIZER_SHA256:
        raise RuntimeError(f"{_QWEN_SRC / 'tokenizer.json.xz'} does not unpack to the expected tokenizer.json")
    (folder / "tokenizer.json").write_bytes(raw)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(_QWEN_SRC / name, folder / name)
