"""llama.cpp as an engine (--engine llama-cpp): its llama-server, found on this machine, serving GGUF
files made once from the models the run names, one server per method and K.

specbench does not speak to llama.cpp any other way than to a server it did not start: the servers
are launched (engines/launch.py) and driven through engines/server.py. This module knows only what
is llama.cpp's own: where its binary is, how a checkpoint becomes a GGUF file (llama.cpp's own
converter, installed beside the binary by `make install-llama-cpp`), and the command line of each
server.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from specbench.core.errors import SpecbenchError

log = logging.getLogger("specbench")

DIR_ENV = "LLAMA_CPP_DIR"  # where `make install-llama-cpp` put it (bin/llama-server, convert/)
DEFAULT_DIR = ".llama-cpp"
BINARY = "llama-server"
INSTALL = (
    "run `make install-llama-cpp` in specbench's checkout (about 10 minutes on 2 cores), or give --llama-server PATH"
)
# What llama.cpp's converter can write (convert_hf_to_gguf.py --outtype); other quantisations come
# from llama.cpp's llama-quantize, which specbench does not build: give a .gguf target for those.
GGUF_TYPES = ("auto", "f32", "f16", "bf16", "q8_0")
DRAFT_SAMPLING = ("greedy", "probabilistic")  # llama-server --spec-draft-sampling
NGRAM_LOOKUPS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v")  # the types with size-n / size-m options
NGRAM_N = 3  # the n-gram they match (see Speculation.args)
# A slot's context beyond the longest prompt and its new tokens: the K drafts of the last round.
SLACK = 64


def find_server(given: str | None = None) -> Path:
    """llama-server: ``given`` (--llama-server), else $LLAMA_CPP_DIR/bin (default .llama-cpp/bin),
    else on PATH. One line saying how to get it when there is none."""
    if given:
        path = Path(given).expanduser()
        if path.is_dir():
            path = path / BINARY
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise SpecbenchError(f"--llama-server {given}: no executable llama-server there; {INSTALL}")
        return path.resolve()
    built = Path(os.environ.get(DIR_ENV, DEFAULT_DIR)).expanduser() / "bin" / BINARY
    if built.is_file() and os.access(built, os.X_OK):
        return built.resolve()
    found = shutil.which(BINARY)
    if found:
        return Path(found).resolve()
    raise SpecbenchError(f"llama.cpp's llama-server is not in {built.parent} nor on PATH: {INSTALL}")


def version(server: Path) -> dict:
    """Which llama.cpp ``server`` is: its path and what --version says (version, build, compiler)."""
    try:
        said = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"path": str(server), "version": f"unknown ({e})"}
    lines = [line.strip() for line in (said.stdout + said.stderr).splitlines() if line.strip()]
    return {"path": str(server), "version": " / ".join(line for line in lines if "version" in line or "built" in line)}


def converter(server: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py installed beside ``server`` (LLAMA_CPP_DIR/convert)."""
    script = server.parent.parent / "convert" / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SpecbenchError(
            f"llama.cpp's GGUF converter is not beside {server} ({script}): {INSTALL}, or give .gguf files"
        )
    return script


def ggufs(
    server: Path,
    gguf_type: str,
    cache: Path,
    target_dir: Path,
    target_gguf: Path | None = None,
    draft_dir: Path | None = None,
    head_dir: Path | None = None,
) -> tuple[Path, Path | None, Path | None]:
    """The GGUF files of the target, the draft and the EAGLE-3 head (None where not given).
    ``gguf_type`` auto keeps the target's own .gguf (``target_gguf``) and converts checkpoints to f32;
    any other type converts every model, the target from its checkpoint ``target_dir``."""
    outtype = "f32" if gguf_type == "auto" else gguf_type
    keep = target_gguf is not None and gguf_type == "auto"
    target = target_gguf if keep else gguf_of(target_dir, outtype, server, cache)
    draft = gguf_of(draft_dir, outtype, server, cache) if draft_dir else None
    head = gguf_of(head_dir, outtype, server, cache, target_dir) if head_dir else None
    return target, draft, head


def gguf_of(checkpoint: Path, outtype: str, server: Path, cache: Path, target: Path | None = None) -> Path:
    """``checkpoint`` (a transformers directory) as a GGUF file of ``outtype``, converted once by
    llama.cpp's own converter and cached under ``cache`` (keyed by the checkpoint's files, so a
    changed checkpoint is converted again). An EAGLE-3 head needs its ``target``'s directory."""
    files = sorted(p for p in checkpoint.iterdir() if p.is_file())
    stamp = "".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns};" for p in files)
    key = hashlib.sha256(f"{checkpoint.resolve()}|{stamp}|{outtype}|{target}".encode()).hexdigest()[:12]
    out = cache / f"{checkpoint.name}-{outtype}-{key}.gguf"
    if out.is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    script = converter(server)
    log.info("converting %s to GGUF (%s) once with llama.cpp's converter, cached in %s", checkpoint.name, outtype, out)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent / "gguf-py"), str(script.parent)])}
    argv = [sys.executable, str(script), str(checkpoint), "--outfile", str(partial), "--outtype", outtype]
    if target is not None:
        argv += ["--target-model-dir", str(target)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        said = (done.stderr or done.stdout).strip().splitlines()
        raise SpecbenchError(
            f"llama.cpp's converter could not make a GGUF of {checkpoint} ({said[-1] if said else done.returncode}): "
            "give a .gguf file instead"
        )
    partial.rename(out)  # only a complete file appears under the final name
    return out


@dataclass(frozen=True)
class Speculation:
    """What a llama-server speculates with: llama.cpp's --spec-type, its K, and for draft models the
    draft's GGUF and how its tokens are drawn (--spec-draft-sampling)."""

    spec_type: str  # draft-simple, draft-eagle3, ngram-simple, ngram-map-k, ...
    k: int
    draft: Path | None = None
    draft_sampling: str = "greedy"
    # --synthetic-acceptance: each position's unconditional acceptance probability (benchmarking only)
    synthetic: tuple[float, ...] = ()

    def args(self) -> list[str]:
        args = ["--spec-type", self.spec_type, "--spec-draft-n-max", str(self.k)]
        if self.synthetic:
            args += ["--spec-synth-rates", ",".join(f"{rate:.6g}" for rate in self.synthetic)]
        if self.draft is not None:
            args += ["--spec-draft-model", str(self.draft), "--spec-draft-sampling", self.draft_sampling]
        if self.spec_type in NGRAM_LOOKUPS:
            # They draft their own length (size-m): K sets it. They match the last size-n tokens, 12 by
            # default, which code and prose seldom repeat: 3, as specbench's prompt lookup and vLLM's
            # ngram here, so the three engines' n-gram rows compare. Below K = 3 they match K tokens:
            # ngram-simple drops a draft shorter than the n-gram it matched (common/ngram-map.cpp,
            # "copy_max < n_draft_min"), so at K = 2 with 3 it never drafted.
            size_n = min(NGRAM_N, self.k)
            args += [f"--spec-{self.spec_type}-size-m", str(self.k), f"--spec-{self.spec_type}-size-n", str(size_n)]
        return args


def command(
    server: Path, model: Path, slots: int, context: int, speculation: Speculation | None = None, threads: int = 0
) -> str:
    """The command line of one llama-server on 127.0.0.1 ({port} for launch to fill in): ``model``,
    ``slots`` requests at once with ``context`` tokens each, speculating as ``speculation`` says.

    Its sampling defaults are made neutral (top-k 0, top-p 1, min-p 0): llama-server's own (top-k 40,
    min-p 0.05, ...) would change the law every engine of a run is compared on; a request's own
    settings still apply. Each slot has a cache of its own, of ``context`` tokens: a unified cache
    makes llama-server clear idle slots, so that every request the audit sends would prefill its
    prompt again instead of finding it in a slot."""
    argv = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", "{port}"]
    argv += ["-np", str(slots), "-c", str(slots * context), "--metrics", "--no-webui"]
    argv += ["--top-k", "0", "--top-p", "1", "--min-p", "0"]
    if threads:
        argv += ["-t", str(threads)]
    if speculation is not None:
        argv += speculation.args()
    return shlex.join(argv).replace("'{port}'", "{port}")
