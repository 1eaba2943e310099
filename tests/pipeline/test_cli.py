"""The `prep` command line: inspect, verify (corruption named), sample-corpus, tokenizer --from, one-line errors."""

import json
import shutil
import subprocess
import sys

import pytest

from pipeline.cli import main
from pipeline.common import REPO_ROOT, UserError
from pipeline.shard_format import read_manifest


def test_inspect_prints_summary_and_decoded_examples(tiny_shards, capsys):
    assert main(["inspect", str(tiny_shards), "--examples", "2"]) == 0
    out = capsys.readouterr().out
    manifest = read_manifest(tiny_shards)
    assert manifest["fingerprint"] in out and f"examples      {manifest['totals']['examples']:,}" in out
    assert out.count("--- example") == 2 and "<extra_id_0>" in out and "targets: <extra_id_0>" in out


def test_verify_passes_then_names_the_corrupted_shard(tiny_shards, tmp_path, capsys):
    copy = tmp_path / "set"
    shutil.copytree(tiny_shards, copy)
    assert main(["verify", str(copy), "--quiet"]) == 0
    assert "ok" in capsys.readouterr().out
    victim = read_manifest(copy)["shards"][2]["path"]
    data = bytearray((copy / victim).read_bytes())
    data[-20] ^= 0xFF  # flip bits inside the last record batch, size unchanged
    (copy / victim).write_bytes(bytes(data))
    assert main(["verify", str(copy), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert victim in err and "sha256" in err and len(err.strip().splitlines()) == 1
    (copy / victim).unlink()
    assert main(["verify", str(copy), "--quiet"]) == 1
    assert "missing" in capsys.readouterr().err


@pytest.mark.parametrize("damage,needle", [
    (lambda m: m["shards"][0].pop("rows"), "shard entry 0 lacks 'rows' (needs path, rows, bytes, sha256)"),
    (lambda m: m["shards"][1].update(bytes="12"), "shard entry 1 'bytes' is '12', not a non-negative integer"),
    (lambda m: m["shards"][0].update(path="../../etc/passwd"),
     "shard entry 0 path '../../etc/passwd' leads outside the shard set"),
    (lambda m: m["shards"].__setitem__(0, "data/part-00000-0000.arrow"), "shard entry 0 is str, not a mapping"),
    (lambda m: m["config"].pop("target_length"), "its config lacks 'target_length'"),
    (lambda m: m.update(shards={}), "its shards is dict, not a list"),
])
def test_a_manifest_entry_lacking_a_field_is_one_line_and_prep_corpus_remakes_it(damage, needle, tiny_shards, tiny_prep,
                                                                                 tmp_path, capsys):
    """`prep verify` and `prep inspect` said KeyError; now the manifest is named with the fix, which works: the same
    `prep corpus` remakes the manifest from the unit records (nothing to run)."""
    from pipeline.corpus import build_shards

    out = tmp_path / "set"
    shutil.copytree(tiny_shards, out)
    manifest = json.loads((out / "manifest.json").read_text())
    damage(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    for argv in (["verify", str(out), "--quiet"], ["inspect", str(out)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{out / 'manifest.json'}: {needle}" in err and "rebuild the shard set with `prep corpus" in err
        assert len(err.strip().splitlines()) == 1, err
    assert build_shards(tiny_prep(out)).units_run == 0
    assert (out / "manifest.json").read_bytes() == (tiny_shards / "manifest.json").read_bytes()


def test_shard_loads_with_datasets_from_file(tiny_shards):
    import datasets

    manifest = read_manifest(tiny_shards)
    first = manifest["shards"][0]
    ds = datasets.Dataset.from_file(str(tiny_shards / first["path"]))
    assert len(ds) == first["rows"]
    row = ds[0]
    assert len(row["input_ids"]) == 128 and len(row["labels"]) == 29


def test_sample_corpus_is_deterministic_and_valid(tmp_path, capsys):
    assert main(["sample-corpus", "--out", str(tmp_path / "a"), "--max-bytes", "100000"]) == 0
    assert main(["sample-corpus", "--out", str(tmp_path / "b"), "--max-bytes", "100000"]) == 0
    a = (tmp_path / "a" / "sample.jsonl").read_bytes()
    assert a == (tmp_path / "b" / "sample.jsonl").read_bytes() and 50_000 < len(a) <= 100_000
    docs = [json.loads(line)["text"] for line in a.decode().splitlines()]
    assert all(d.strip() for d in docs) and len(docs) >= 5


def test_tokenizer_from_file_adds_sentinels(tmp_path, capsys):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<pad>": 0, "</s>": 1, "<unk>": 2, "a": 3}, unk_token="<unk>")).save(
        str(tmp_path / "plain.json"))
    assert main(["tokenizer", "--from", str(tmp_path / "plain.json"), "--out", str(tmp_path / "tok")]) == 0
    assert "<extra_id_0>=103" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["corpus", "--input", "/nonexistent/x.jsonl", "--tokenizer", "t.json", "--out", "o"], "t.json: tokenizer file not found"),
    (["inspect", "/nonexistent/set"], "no manifest"),
    (["tokenizer", "--out", "o"], "nothing to train on"),
])
def test_user_errors_are_one_line_exit_2(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_console_script_help_and_error_exit_code(tmp_path):
    prep = shutil.which("prep", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert prep, "the `prep` console script is not installed in the venv"
    out = subprocess.run([prep, "corpus", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--noise-density" in out and "span-corruption" in out
    done = subprocess.run([prep, "verify", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def _corpus_config(argv):
    from pipeline.cli import build_parser, config_from_args
    from pipeline.config import CorpusConfig

    return config_from_args(CorpusConfig, build_parser().parse_args(["corpus", *argv]))


def test_corpus_settings_flags_over_config_file_over_defaults(tmp_path):
    (tmp_path / "prep.yaml").write_text("input_length: 128\nshard-rows: 512\nseed: 7\n")
    config = _corpus_config(["--input", "c.jsonl", "--tokenizer", "t.json", "--out", "o",
                             "--config", str(tmp_path / "prep.yaml"), "--seed", "5"])
    assert (config.input_length, config.shard_rows, config.seed, config.noise_density) == (128, 512, 5, 0.15)
    (tmp_path / "bad.yaml").write_text("input_lenght: 128\n")
    with pytest.raises(UserError, match=r"bad.yaml: unknown keys \['input_lenght'\]"):
        _corpus_config(["--input", "c.jsonl", "--tokenizer", "t.json", "--out", "o",
                        "--config", str(tmp_path / "bad.yaml")])


def test_a_config_file_that_is_not_utf8_or_not_a_file_is_one_line_naming_it(tmp_path, capsys):
    """A file in another encoding was a UnicodeDecodeError traceback; a directory was called missing."""
    (tmp_path / "utf16.yaml").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "configs").mkdir()
    for name, needle in (("utf16.yaml", "not UTF-8 text (byte 0 is 0xff); save the config file as UTF-8"),
                         ("configs", "a directory, not a config file"), ("nope.yaml", "no such config file")):
        argv = ["tokenizer", "--config", str(tmp_path / name), "--input", "c.jsonl", "--out", str(tmp_path / "tok")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / name}: {needle}" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "tok").exists()


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs" / "prep").glob("*.yaml")), ids=lambda p: p.name)
def test_every_prep_config_file_is_valid(path):
    config = _corpus_config(["--input", "c.jsonl", "--tokenizer", "t.json", "--out", "o", "--config", str(path)])
    assert config.span_spec().raw_length > config.input_length


def test_the_demo_prep_config_gives_the_online_loader_a_unit_per_rank_and_worker(tmp_path):
    """scripts/demo.sh preps the whole sample corpus with configs/prep/sample.yaml, and its study then runs
    `--loader online` on 2 ranks x 2 workers from that set's units: there must be at least 4."""
    from pipeline.readers import discover_inputs, plan_units
    from pipeline.sample_corpus import write_sample_corpus

    path, _, _ = write_sample_corpus(tmp_path)
    config = _corpus_config(["--input", str(path), "--tokenizer", "t.json", "--out", "o",
                             "--config", str(REPO_ROOT / "configs" / "prep" / "sample.yaml")])
    assert len(plan_units(discover_inputs([str(path)]), config.unit_bytes)) >= 2 * 2


def test_the_default_worker_count_is_the_cores_this_process_may_use_not_the_hosts(tmp_path):
    """Under Slurm (--cpus-per-task) or taskset a job sees the node's every core in os.cpu_count(); the defaults that
    size Ray's workers and a CPU rank's threads follow the affinity instead."""
    script = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
              "from pipeline.common import usable_cores\n"
              "from pipeline.config import CorpusConfig\n"
              "print(usable_cores(), CorpusConfig.__dataclass_fields__['workers'].default)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1"]
