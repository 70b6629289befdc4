"""What reading a GGUF file leaves on disk, so that the next load of the same file skips the slow part.

gguf's `GGUFReader` turns every metadata value into numpy views one element at a time, and transformers builds
the tokenizer by reading the file once more: for the embedded SmolLM2 (49,152 tokens, 48,900 merges) about 6 s
and 4.5 s of a ~15 s start on a 2-core CPU, and more for the 128k-token vocabularies of Llama 3. Neither depends
on anything but the file, so the first load keeps its results here: the Hugging Face config and generation
defaults, where each tensor lies in the file (`gguf_loader.TensorRef`), and the tokenizer as transformers saves
it (tokenizer.json and its config: loaded back in a fraction of a second). The weights themselves are read
from the GGUF file as before (dequantized at each load), so the cache stays small (a few MB).

An entry is keyed by the file's absolute path, size and modification time, this module's format version and
the transformers and gguf versions that made it: an edited or replaced file, or an upgrade, makes a new entry.
Entries are written to a temporary folder and renamed into place (two processes loading one file at once both
succeed); one that cannot be read back is removed and made again. The root is $HERON_CACHE_DIR, else
$XDG_CACHE_HOME/heron, else ~/.cache/heron; where it cannot be written, loading works as without it (a warning
says so).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from importlib.metadata import version

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when what gguf_loader stores (or how it converts) changes
CONTENTS = "contents.json"
TOKENIZER = "tokenizer"


def cache_root() -> str:
    if root := os.environ.get("HERON_CACHE_DIR"):
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "heron")


def entry_dir(path: str) -> str:
    """The folder of `path`'s entry (which may not exist)."""
    st = os.stat(path)
    key = "\0".join(
        map(str, (FORMAT, os.path.abspath(path), st.st_size, st.st_mtime_ns, version("transformers"), version("gguf")))
    )
    return os.path.join(cache_root(), "gguf", hashlib.sha256(key.encode()).hexdigest()[:32])


def load(path: str) -> tuple[dict, object] | None:
    """(contents, tokenizer) of `path`'s entry, or None where there is none (or it is unreadable: removed)."""
    folder = entry_dir(path)
    if not os.path.isdir(folder):
        return None
    try:
        from transformers import PreTrainedTokenizerFast

        with open(os.path.join(folder, CONTENTS)) as f:
            contents = json.load(f)
        return contents, PreTrainedTokenizerFast.from_pretrained(os.path.join(folder, TOKENIZER))
    except Exception as e:  # a partial copy, a disk error, a format we no longer read: make it again
        logger.warning("GGUF cache entry %s for %s is unreadable (%s); converting the file again", folder, path, e)
        shutil.rmtree(folder, ignore_errors=True)
        return None


def store(path: str, contents: dict, tokenizer) -> None:
    """Keep `contents` (JSON-serialisable) and `tokenizer` as `path`'s entry; a failure only logs."""
    folder = entry_dir(path)
    tmp = None
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(folder))
        with open(os.path.join(tmp, CONTENTS), "w") as f:
            json.dump(contents, f)
        tokenizer.save_pretrained(os.path.join(tmp, TOKENIZER))
        os.rename(tmp, folder)  # atomic; fails where another process got there first, which is as good
        tmp = None
    except Exception as e:  # a read-only or full disk, a tokenizer that cannot be saved
        if not os.path.isdir(folder):
            logger.warning("cannot cache the conversion of %s under %s (%s): each load reads the file", path, folder, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
