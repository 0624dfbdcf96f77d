"""The FineWeb-Edu configs: one per paper-scale OpenWebText config, differing only in the data."""
from dataclasses import asdict
from pathlib import Path

from pretrain.config import load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "owt"


def test_every_openwebtext_config_has_a_fineweb_edu_twin():
    openwebtext = sorted(p for p in CONFIGS.glob("*.yaml") if not p.stem.endswith("_fineweb_edu"))
    assert len(openwebtext) == 7
    for path in openwebtext:
        twin = path.with_name(f"{path.stem}_fineweb_edu.yaml")
        owt, fineweb = asdict(load_config(path)), asdict(load_config(twin))
        assert fineweb["data"]["path"] == "checkpoints/datasets/fineweb-edu-10bt-gpt2-1024"
        assert fineweb["run_name"] == owt["run_name"].replace("owt-", "fineweb-edu-", 1)
        for config in (owt, fineweb):
            del config["run_name"], config["data"]["path"]
        assert fineweb == owt, twin.name
        assert "--source hf:HuggingFaceFW/fineweb-edu:sample-10BT" in twin.read_text()
