"""Turns a training run's output into the shipped Hugging Face model directories.

    python -m hipfire_serve.demo.package --run RUN_DIR --corpus CORPUS_DIR

RUN_DIR holds what `hipfire_serve.demo.train` wrote (target halves, draft, record.json);
CORPUS_DIR what `hipfire_serve.demo.corpus` wrote (tokenizer files, manifest.json). Each model
directory gets `config.json`, `generation_config.json`, `model.safetensors` (bf16, one file),
`tokenizer.json` and `tokenizer_config.json`. The run record and the corpus manifest are kept
beside the package code (`training_record.json`, `corpus_manifest.json`) for the docs.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from hipfire_serve.demo import demo_draft_dir, demo_model_dir
from hipfire_serve.demo.model import DemoModelConfig
from hipfire_serve.demo.tokenizer import END_OF_TEXT, IM_END

DEMO_DIR = Path(__file__).resolve().parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def generation_config(eos_ids: list[int], pad_id: int) -> dict:
    # Greedy by default: the demo pair is for showing speculation, where greedy output is
    # token-identical with and without drafts.
    return {"eos_token_id": eos_ids, "pad_token_id": pad_id, "do_sample": False}


def write_model_dir(
    out_dir: Path, tensors: dict, cfg: DemoModelConfig, corpus_dir: Path, special: dict
) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    eos_ids = [special[IM_END], special[END_OF_TEXT]]
    pad_id = special[END_OF_TEXT]
    (out_dir / "config.json").write_text(json.dumps(cfg.hf_config(eos_ids, pad_id), indent=2))
    (out_dir / "generation_config.json").write_text(
        json.dumps(generation_config(eos_ids, pad_id), indent=2)
    )
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copyfile(corpus_dir / name, out_dir / name)


def package(run_dir: Path, corpus_dir: Path) -> None:
    record = json.loads((run_dir / "record.json").read_text())
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    special = manifest["special_token_ids"]
    target = {}
    for part in sorted(run_dir.glob("target.part*.safetensors")):
        target.update(load_file(str(part)))
    draft = load_file(str(run_dir / "draft.safetensors"))
    write_model_dir(
        demo_model_dir(), target, DemoModelConfig(**record["target_config"]), corpus_dir, special
    )
    write_model_dir(
        demo_draft_dir(), draft, DemoModelConfig(**record["draft_config"]), corpus_dir, special
    )
    (DEMO_DIR / "training_record.json").write_text(json.dumps(record, indent=1) + "\n")
    (DEMO_DIR / "corpus_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the demo model directories")
    parser.add_argument("--run", type=Path, required=True, help="training output folder")
    parser.add_argument("--corpus", type=Path, required=True, help="corpus folder")
    args = parser.parse_args(argv)
    package(args.run, args.corpus)
    for d in (demo_model_dir(), demo_draft_dir()):
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{d}: {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
