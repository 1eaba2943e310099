"""A careless user's `prep` never loses data, never hangs, never sees a traceback (issue 14, prep side).

Every subcommand against outputs that are a file, read-only or full (tmpfs mounts; skipped where mounting is
refused); every input format against truncated and corrupt files; every destructive flag against a directory it
did not write; `--ray-address` to nowhere; kill -9 of prep (no Ray process outlives it); jobs with 0 examples.
All real: Ray, tokenizers, Arrow, the `prep` command line.
"""

from __future__ import annotations

import gzip
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.cli import main
from pipeline.common import REPO_ROOT, UserError
from pipeline.shard_format import MARKER_NAME, read_manifest

TINY = ["--input-length", "128", "--unit-bytes", "100000", "--shard-rows", "100", "--workers", "2", "--quiet"]


@pytest.fixture(scope="module")
def ray_once():
    """One local Ray instance for the in-process `prep corpus` calls of this module (the executor uses it)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


def refused(argv: list[str], capsys, *needles: str) -> str:
    """Run `prep ARGV` in-process; it must exit 2 with one line naming every needle and no traceback."""
    code = main(argv)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, (code, captured.out[-2000:], captured.err[-3000:])
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def corpus_argv(inputs, tokenizer, out, *extra) -> list[str]:
    return ["corpus", "--input", *map(str, inputs), "--tokenizer", str(tokenizer), "--out", str(out), *TINY, *extra]


# -- 1: destructive flags touch only what prep wrote ----------------------------------------------------------------

def test_corpus_refuses_an_out_it_did_not_write_with_or_without_overwrite(sample_corpus, tiny_tokenizer, tmp_path,
                                                                          capsys):
    """The issue's reproduction: the corpus at p/data/c.jsonl and `--out p` (then --overwrite) deleted the corpus."""
    project = tmp_path / "p"
    (project / "data").mkdir(parents=True)
    shutil.copy(sample_corpus, project / "data" / "c.jsonl")
    (project / "notes.md").write_text("mine")
    before = tree(project)
    for extra in ([], ["--overwrite"]):
        refused(corpus_argv([project / "data" / "c.jsonl"], tiny_tokenizer, project, *extra), capsys,
                "lies inside --out")
        refused(corpus_argv([sample_corpus], tiny_tokenizer, project, *extra), capsys,
                f"{project}: not empty", MARKER_NAME, "nothing was changed")
    assert tree(project) == before


def test_overwrite_removes_only_prep_files_and_says_so_first(tiny_shards, tiny_prep, tmp_path, ray_once, capsys):
    from pipeline.corpus import build_shards

    out = tmp_path / "set"
    shutil.copytree(tiny_shards, out)
    (out / "notes.md").write_text("mine")
    (out / "data" / "mine.arrow").write_bytes(b"a file of the user's")
    (out / "units" / "README").write_text("also mine")
    old = read_manifest(out)
    build_shards(tiny_prep(out, seed=1, overwrite=True))
    said = capsys.readouterr().err
    assert (f"removing the shard set {old['fingerprint'][:12]}... in {out}: manifest.json, "
            f"{old['totals']['units']} unit records, {len(old['shards'])} shards") in said, said
    assert (out / "notes.md").read_text() == "mine" and (out / "units" / "README").read_text() == "also mine"
    assert (out / "data" / "mine.arrow").read_bytes() == b"a file of the user's"
    new = read_manifest(out)
    assert new["config"]["seed"] == 1 and new["fingerprint"] != old["fingerprint"]
    assert {p.name for p in (out / "data").iterdir()} == {Path(s["path"]).name for s in new["shards"]} | {"mine.arrow"}


@pytest.mark.parametrize("extra,needle", [
    (["--seed", "-1"], "--seed -1 must be >= 0"),
    (["--noise-density", "0.99", "--mean-span-length", "1000"], "use --noise-density 0.98 or less"),
    (["--input-length", "4096", "--mean-span-length", "1"], "sentinels per example"),
    (["--unit-bytes", "10"], "--unit-bytes 10 is too small"),
])
def test_a_bad_option_with_overwrite_is_refused_before_the_old_set_is_touched(extra, needle, tiny_shards, sample_corpus,
                                                                             tiny_tokenizer, tmp_path, capsys):
    """`--overwrite --seed -1` removed the old set and then crashed inside Ray: every option is checked first."""
    out = tmp_path / "set"
    shutil.copytree(tiny_shards, out)
    before = tree(out)
    refused(corpus_argv([sample_corpus], tiny_tokenizer, out, "--overwrite", *extra), capsys, needle)
    assert tree(out) == before


def without_staging(path: Path) -> dict[str, bytes]:
    return {name: data for name, data in tree(path).items() if not name.startswith(".next/")}


def test_an_overwrite_that_fails_leaves_the_old_set_whole_and_a_rerun_finishes_it(tiny_shards, tiny_prep, tmp_path,
                                                                                   ray_once, capsys):
    """The new set is made beside the old one (--out/.next/): a corrupt input found inside Ray, after the good
    units are done, stops the job with the old set still complete and verified (it was removed first, before); once
    the input is fixed the same command replaces the old set, and what the failed attempt left in .next/ goes."""
    from pipeline.corpus import build_shards

    out = tmp_path / "set"
    shutil.copytree(tiny_shards, out)
    before = tree(out)
    shutil.copy(tiny_prep(out).input[0], tmp_path / "a.jsonl")
    text = (tmp_path / "a.jsonl").read_bytes()[:100_000]
    whole = gzip.compress(text[: text.rindex(b"\n") + 1])
    bad = tmp_path / "z.jsonl.gz"  # the last unit; one worker runs the units in order
    bad.write_bytes(whole[: len(whole) // 2])  # cut short: fails inside its unit
    inputs = [tmp_path / "a.jsonl", bad]
    with pytest.raises(UserError, match="z.jsonl.gz"):
        build_shards(tiny_prep(out, inputs=inputs, seed=1, overwrite=True, workers=1))
    assert without_staging(out) == before and main(["verify", str(out), "--quiet"]) == 0
    assert list((out / ".next" / "units").glob("*.json")), "the good units' work is kept for the rerun"
    assert "stays until it is complete" in capsys.readouterr().err
    bad.write_bytes(whole)
    result = build_shards(tiny_prep(out, inputs=inputs, seed=1, overwrite=True, workers=1))
    assert result.units_total == 5 and len(read_manifest(out)["inputs"]) == 2
    assert read_manifest(out)["config"]["seed"] == 1 and not (out / ".next").exists()
    assert main(["verify", str(out), "--quiet"]) == 0


def test_an_overwrite_cut_short_while_moving_the_new_set_in_is_finished_by_a_rerun(tiny_shards, tiny_prep, tmp_path,
                                                                                   ray_once):
    """The state a crash leaves halfway through the swap (the old set removed, half of the new units moved in, the
    rest in .next/): the same command, with or without --overwrite, moves the rest in without making them again."""
    from pipeline.corpus import build_shards

    reference = tmp_path / "reference"
    build_shards(tiny_prep(reference, seed=1))
    out = tmp_path / "set"
    shutil.copytree(tiny_shards, out)
    for path in [out / "manifest.json", *(out / "units").iterdir(), *(out / "data").iterdir()]:
        path.unlink()
    shutil.copytree(reference / "units", out / ".next" / "units")
    shutil.copytree(reference / "data", out / ".next" / "data")
    moved = json.loads((out / ".next" / "units" / "00000.json").read_text())
    for name in [s["path"] for s in moved["shards"]] + ["units/00000.json"]:
        os.replace(out / ".next" / name, out / name)
    result = build_shards(tiny_prep(out, seed=1))
    assert result.units_run == 0 and not (out / ".next").exists()
    assert read_manifest(out) == read_manifest(reference) and tree(out) == tree(reference)


def test_a_set_without_the_marker_but_with_its_manifest_is_still_ours(tiny_shards, tiny_prep, tmp_path):
    from pipeline.corpus import build_shards

    out = tmp_path / "older"
    shutil.copytree(tiny_shards, out)
    (out / MARKER_NAME).unlink()  # a set written before the marker existed
    assert build_shards(tiny_prep(out)).already_complete


def test_tokenizer_refuses_to_replace_one_and_overwrite_keeps_the_old_file(tiny_tokenizer, sample_corpus, tmp_path,
                                                                           capsys):
    from tokenizer.t5 import tokenizer_sha256

    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(tiny_tokenizer, tok / "tokenizer.json")
    old = (tok / "tokenizer.json").read_bytes()
    sha12 = tokenizer_sha256(tok / "tokenizer.json")[:12]
    started = time.monotonic()
    refused(["tokenizer", "--input", str(sample_corpus), "--vocab-size", "1024", "--out", str(tok)], capsys,
            f"{tok / 'tokenizer.json'}: a tokenizer is already there", "shard set", "--overwrite",
            f"tokenizer.json.bak-{sha12}")
    assert time.monotonic() - started < 5  # refused before any training
    assert (tok / "tokenizer.json").read_bytes() == old
    plain = tmp_path / "plain.json"
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<pad>": 0, "</s>": 1, "<unk>": 2, "a": 3}, unk_token="<unk>")).save(str(plain))
    assert main(["tokenizer", "--from", str(plain), "--out", str(tok), "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert f"tokenizer.json.bak-{sha12}" in out
    assert (tok / f"tokenizer.json.bak-{sha12}").read_bytes() == old
    assert "<extra_id_0>=103" in out and (tok / "tokenizer.json").read_bytes() != old


def test_sample_corpus_never_replaces_a_file_it_did_not_write(tmp_path, capsys):
    (tmp_path / "sample.jsonl").write_text('{"text": "my own corpus"}\n')
    refused(["sample-corpus", "--out", str(tmp_path), "--max-bytes", "20000"], capsys, "sample.jsonl: already there")
    assert (tmp_path / "sample.jsonl").read_text() == '{"text": "my own corpus"}\n'
    assert main(["sample-corpus", "--out", str(tmp_path / "s"), "--max-bytes", "20000"]) == 0
    assert main(["sample-corpus", "--out", str(tmp_path / "s"), "--max-bytes", "20000"]) == 0  # same bytes: fine
    assert "unchanged" in capsys.readouterr().out


def test_counts_out_of_range_are_refused_before_anything_is_written(tiny_shards, tmp_path, capsys):
    """sample-corpus --max-bytes 0 read the whole standard library and wrote an empty corpus (exit 0); inspect
    --examples -1 decoded every example; tokenizer --max-bytes 0 trained on nothing and advised a vocabulary size
    below the smallest."""
    out = tmp_path / "out"
    for argv, needle in ((["sample-corpus", "--out", str(out), "--max-bytes", "0"], "--max-bytes 0 must be >= 10000"),
                         (["sample-corpus", "--out", str(out), "--max-bytes", "-5"], "--max-bytes -5 must be >= 10000"),
                         (["inspect", str(tiny_shards), "--examples", "-1"], "--examples -1 must be >= 0"),
                         (["tokenizer", "--input", "sample", "--out", str(out), "--max-bytes", "0"],
                          "--max-bytes 0 must be >= 1")):
        refused(argv, capsys, needle)
    assert not out.exists()
    assert main(["inspect", str(tiny_shards), "--examples", "0"]) == 0
    assert "--- example" not in capsys.readouterr().out


def test_tokenizer_max_bytes_counts_utf8_bytes_not_characters():
    from pipeline.cli import _capped

    texts = ["\u00e9" * 3000, "second", "third"]  # 3,000 characters, 6,000 bytes
    assert list(_capped(iter(texts), 5000)) == texts[:1]
    assert list(_capped(iter(texts), 6001)) == texts[:2]
    assert list(_capped(iter(texts), None)) == texts


# -- 5 and 7: no hang, no orphan -----------------------------------------------------------------------------------

def test_ray_address_where_no_cluster_answers_is_refused_within_seconds(tiny_tokenizer, sample_corpus, tmp_path):
    """Nothing listening (127.0.0.1:1), and a listener that is no Ray cluster (an HTTP server): the real `prep`
    in a fresh process (no Ray started) says so in one line, instead of Ray retrying for minutes."""
    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for address in ("127.0.0.1:1", f"127.0.0.1:{server.server_port}"):
            started = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "pipeline.cli",
                                   *corpus_argv([sample_corpus], tiny_tokenizer, tmp_path / "o", "--ray-address",
                                                address)], capture_output=True, text=True, timeout=120,
                                  cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
            assert f"--ray-address {address}: no Ray cluster answers there" in lines[0] and "ray start" in lines[0]
            assert time.monotonic() - started < 30
    finally:
        server.shutdown()
    assert not (tmp_path / "o").exists()


def test_sigterm_then_kill_minus_9_of_prep_leave_no_ray_process_behind(sample_corpus, tiny_tokenizer, tmp_path):
    """SIGTERM: one line, exit 143, finished units kept; then the resumed run is SIGKILLed (the driver alone, as
    `kill -9 PID` does): in both cases no process of prep's local Ray cluster survives (psutil).

    After the kill the reaper finds Ray's agents, orphaned by the raylet's death, by their token alone."""
    import psutil

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(sample_corpus.read_bytes() * 4)  # 16 units: still running when stopped
    out = tmp_path / "stopped"

    def start_and_wait(units_before: int):
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *corpus_argv([corpus], tiny_tokenizer, out)],
                                cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while (len(list((out / "units").glob("*.json"))) <= units_before and proc.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.05)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert {"raylet", "gcs_server"} <= {p.name() for p in family if p.is_running()}
        return proc, family

    def assert_all_gone(family) -> None:
        # Ray's agents die a few seconds after the raylet; on a loaded 2-core machine that took just over 20 s
        deadline = time.monotonic() + 60
        while (alive := [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        described = [describe(p) for p in alive]
        for p in alive:
            p.kill()
        assert not alive, described

    def describe(p) -> tuple:
        try:
            token = b"T5ZERO_PREP_CLUSTER=" in open(f"/proc/{p.pid}/environ", "rb").read()
            return p.pid, p.name(), p.status(), "ppid", p.ppid(), "token", token
        except (OSError, psutil.Error) as err:
            return p.pid, repr(err)

    proc, family = start_and_wait(0)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert proc.returncode == 143 and lines == ["stopped by SIGTERM; finished work units are kept, and the same "
                                                "command resumes"], stderr[-3000:]
    assert_all_gone(family)
    kept = len(list((out / "units").glob("*.json")))
    assert kept >= 1 and not (out / "manifest.json").exists()

    proc, family = start_and_wait(kept)
    reapers = [p for p in family if "T5ZERO_PREP_CLUSTER" in " ".join(p.cmdline())]
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert reapers, "no reaper among the driver's children"
    assert_all_gone(family)
    assert not (out / "manifest.json").exists()


# -- 11: a job with no examples -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,body,extra,needles", [
    ("empty.jsonl", b"", [], ["no examples made (0 documents", "pass a corpus with text"]),
    ("blank.txt", b"\n\n  \n\n", [], ["no examples made (0 documents"]),
    ("ints.jsonl", b'{"text": "a", "n": 1}\n' * 5, ["--text-field", "n"], ["not_text 5", "--text-field (now 'n')"]),
    ("short.jsonl", b'{"text": "just a few words"}\n', [], ["tokens; an example needs 141 tokens", "more text"]),
])
def test_no_examples_is_an_error_that_says_why(name, body, extra, needles, tiny_tokenizer, tmp_path, ray_once,
                                               capsys):
    (tmp_path / name).write_bytes(body)
    out = tmp_path / "out"
    refused(corpus_argv([tmp_path / name], tiny_tokenizer, out, *extra), capsys, str(tmp_path / name), *needles)
    assert not (out / "manifest.json").exists() and not list((out / "units").glob("*.json"))


def test_a_parquet_int_column_is_named_not_text(tiny_tokenizer, tmp_path, ray_once, capsys):
    pq.write_table(pa.table({"text": ["some words"] * 3, "n": [1, 2, 3]}), tmp_path / "c.parquet")
    refused(corpus_argv([tmp_path / "c.parquet"], tiny_tokenizer, tmp_path / "out", "--text-field", "n"), capsys,
            "column 'n' is int64, not text", "string columns: text")


# -- 13: every input format, truncated or corrupt: one line naming the file ------------------------------------------

def _corrupt_inputs(sample_corpus: Path, where: Path) -> dict[str, str]:
    """name -> a word the error must say. Each file is broken in the way its name says."""
    import datasets
    import zstandard

    data = sample_corpus.read_bytes()[:100_000]
    data = data[: data.rindex(b"\n") + 1]
    gz = gzip.compress(data)
    (where / "truncated.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    bad_crc = bytearray(gz)
    bad_crc[-8] ^= 0xFF
    (where / "bad_crc.jsonl.gz").write_bytes(bytes(bad_crc))
    (where / "not_gzip.txt.gz").write_bytes(data[:5000])
    (where / "not_zstd.jsonl.zst").write_bytes(data[:5000])
    zst = zstandard.ZstdCompressor().compress(data)
    (where / "truncated.jsonl.zst").write_bytes(zst[: len(zst) // 2])
    (where / "garbage.parquet").write_bytes(b"PAR1 but not really" * 50)
    texts = [json.loads(line)["text"] for line in data.decode().splitlines()]
    pq.write_table(pa.table({"text": texts}), where / "full.parquet")
    (where / "truncated.parquet").write_bytes((where / "full.parquet").read_bytes()[:-100])
    (where / "full.parquet").unlink()
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(where / "hf_truncated"))
    arrow = next((where / "hf_truncated").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    datasets.Dataset.from_dict({"text": texts[:3]}).save_to_disk(str(where / "hf_bad_state"))
    (where / "hf_bad_state" / "state.json").write_text("{ not json")
    (where / "binary.jsonl").write_bytes(bytes(range(256)) * 40)
    return {"truncated.jsonl.gz": "EOFError", "bad_crc.jsonl.gz": "CRC check failed", "not_gzip.txt.gz": "gzip",
            "not_zstd.jsonl.zst": "ZstdError", "truncated.jsonl.zst": "truncated", "garbage.parquet": "Parquet",
            "truncated.parquet": "Parquet", "hf_truncated": "read", "hf_bad_state": "JSONDecodeError",
            "binary.jsonl": "no examples made"}


@pytest.fixture(scope="module")
def corrupt_inputs(sample_corpus, tmp_path_factory):
    where = tmp_path_factory.mktemp("corrupt")
    return where, _corrupt_inputs(sample_corpus, where)


CORRUPT = ["truncated.jsonl.gz", "bad_crc.jsonl.gz", "not_gzip.txt.gz", "not_zstd.jsonl.zst", "truncated.jsonl.zst",
           "garbage.parquet", "truncated.parquet", "hf_truncated", "hf_bad_state", "binary.jsonl"]


@pytest.mark.parametrize("name", CORRUPT)
def test_corrupt_input_is_one_line_naming_it_in_prep_corpus(name, corrupt_inputs, tiny_tokenizer, tmp_path, ray_once,
                                                            capsys):
    where, says = corrupt_inputs
    line = refused(corpus_argv([where / name], tiny_tokenizer, tmp_path / "out"), capsys, says[name])
    assert str(where / name) in line


@pytest.mark.parametrize("name", [n for n in CORRUPT if n != "binary.jsonl"])
def test_corrupt_input_is_one_line_naming_it_in_prep_tokenizer(name, corrupt_inputs, tmp_path, capsys):
    where, says = corrupt_inputs
    line = refused(["tokenizer", "--input", str(where / name), "--vocab-size", "300", "--out", str(tmp_path / "t")],
                   capsys, says[name])
    assert str(where / name) in line and not (tmp_path / "t").exists()   # no --out made for a run that failed


def test_a_shard_set_or_tokenizer_inside_the_corpus_directory_is_not_corpus(tiny_shards, sample_corpus, tmp_path,
                                                                            capsys):
    from pipeline.readers import discover_inputs

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(sample_corpus, corpus / "c.jsonl")
    shutil.copytree(tiny_shards, corpus / "shards")  # its manifest.json and units/*.json are not documents
    (corpus / "tok").mkdir()
    (corpus / "tok" / "tokenizer.json").write_text("{}")
    assert [Path(i.path).name for i in discover_inputs([str(corpus)])] == ["c.jsonl"]
    with pytest.raises(UserError, match="a shard set written by `prep corpus`, not a corpus"):
        discover_inputs([str(corpus / "shards")])


# -- 13: every subcommand against outputs that are a file, read-only or full ----------------------------------------

def test_every_subcommand_refuses_a_file_where_a_directory_belongs(tiny_tokenizer, sample_corpus, tmp_path, capsys):
    file = tmp_path / "a_file"
    file.write_text("keep me")
    for argv in (["sample-corpus", "--out", str(file)],
                 ["tokenizer", "--from", str(tiny_tokenizer), "--out", str(file)],
                 corpus_argv([sample_corpus], tiny_tokenizer, file),
                 ["inspect", str(file)],
                 ["verify", str(file)]):
        refused(argv, capsys, str(file), "not a directory" if argv[0] != "inspect" and argv[0] != "verify"
                else "not a shard set directory")
    assert file.read_text() == "keep me"


def test_every_subcommand_on_a_read_only_output(tmpfs, tiny_shards, tiny_tokenizer, sample_corpus, tiny_prep,
                                                capsys):
    """Writers refuse in one line before doing any work; readers (inspect, verify, a finished corpus) just work."""
    from pipeline.corpus import build_shards

    empty = tmpfs.read_only(tmpfs("empty"))
    refused(["sample-corpus", "--out", str(empty), "--max-bytes", "20000"], capsys, "Read-only file system")
    refused(["tokenizer", "--input", str(sample_corpus), "--vocab-size", "1024", "--out", str(empty / "tok")], capsys,
            "Read-only file system")
    refused(corpus_argv([sample_corpus], tiny_tokenizer, empty / "set"), capsys, "Read-only file system")
    finished = tmpfs("finished", "size=8m")
    shutil.copytree(tiny_shards, finished / "set")
    tmpfs.read_only(finished)
    assert main(["inspect", str(finished / "set"), "--examples", "1"]) == 0
    assert main(["verify", str(finished / "set"), "--quiet"]) == 0
    assert build_shards(tiny_prep(finished / "set")).already_complete  # nothing to write: no error
    capsys.readouterr()


def test_every_writer_on_a_full_output_then_resumes(tmpfs, tiny_shards, tiny_tokenizer, sample_corpus, tiny_prep,
                                                    ray_once, capsys):
    """A 2 MiB tmpfs filled up: one line naming the file, no temp file left, what was written kept; prep corpus
    finishes the set once there is room, byte-identical to the fixture's."""
    full = tmpfs("full", "size=2m")

    def fill(leave: int) -> Path:
        filler = full / "filler"
        filler.unlink(missing_ok=True)
        free = shutil.disk_usage(full).free
        filler.write_bytes(b"\0" * max(0, free - leave))
        return filler

    fill(8 << 10)
    refused(["sample-corpus", "--out", str(full / "s"), "--max-bytes", "100000"], capsys, "No space left on device")
    refused(["tokenizer", "--from", str(tiny_tokenizer), "--out", str(full / "tok")], capsys,
            "No space left on device")
    assert not [p for p in full.rglob("*") if p.name.endswith(".tmp")]
    filler = fill(300 << 10)  # room for the marker and some shards, not for the ~1 MB set
    refused(corpus_argv([sample_corpus], tiny_tokenizer, full / "set"), capsys, "No space left on device",
            "a rerun resumes")
    assert not [p for p in (full / "set").rglob("*") if p.name.endswith(".tmp")]
    filler.unlink()
    from pipeline.corpus import build_shards

    build_shards(tiny_prep(full / "set"))
    assert read_manifest(full / "set")["shards"] == read_manifest(tiny_shards)["shards"]
    assert main(["verify", str(full / "set"), "--quiet"]) == 0
