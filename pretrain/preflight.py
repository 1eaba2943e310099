"""Preflight: everything `pretrain` checks before it spawns a rank or builds a model.

    plan = run_preflight(config, world_size=2, local_world_size=2, announce=True)

1. The shard set against the model: the model vocabulary (resolved here, see `resolve_vocab_size`) holds the
   tokenizer's ids and sentinels, pad/eos agree, lengths equal `--input-length/--target-length` when given,
   the tokenizer file's sha256 equals the manifest's when `--tokenizer` is given, one global batch fits.
2. Memory: DeepSpeed's own estimators for the model states (`estimate_zero2_model_states_mem_needs`,
   `estimate_zero3_model_states_mem_needs`; stages 0 and 1 by the same byte counting) plus a rough activation
   estimate (`pretrain.model.memory.estimate_memory`, whose docstring writes the formula out), printed beside
   the devices' memory. A run that cannot fit is refused unless `--force`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.common import UserError, sha256_file, usable_cores
from pretrain.config import AUTO_GRAPHS_MEMORY_SHARE, memory_share
from pretrain.ds_config import resolve_precision
from pretrain.model.memory import GIB, estimate_memory

VOCAB_MULTIPLE = 128
FIT_FRACTION = 0.92        # refuse when the estimate exceeds this share of the device's memory


@dataclass
class Plan:
    """What the preflight resolved: model shape, lengths, batch layout, the memory estimate."""

    model_config: Any                    # pretrain.model.t5.T5Config with the resolved vocabulary
    vocab_note: str
    input_length: int
    target_length: int
    num_examples: int
    world_size: int
    grad_accum: int
    global_batch: int
    shard_fingerprint: str
    tokenizer_sha256: str
    device: dict[str, Any]
    memory_estimate: dict[str, Any]
    warnings: list[str] = field(default_factory=list)

    def memory_share(self) -> float | None:
        """The memory estimate over one GPU's memory (what --cudagraphs auto weighs), None without a GPU."""
        return memory_share(self.memory_estimate["per_gpu_gib"], self.device)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["model_config"] = self.model_config.to_dict()
        return out


def resolve_vocab_size(preset_vocab: int, tokenizer_vocab: int, pinned: int | None) -> tuple[int, str]:
    """Model vocabulary for a shard set: pinned if given; the preset's (published) size when the tokenizer
    fits in it; else the tokenizer's size rounded up to a multiple of 128."""
    if pinned is not None:
        if pinned < tokenizer_vocab:
            raise UserError(f"--vocab-size {pinned} is smaller than the shard set's tokenizer ({tokenizer_vocab} "
                            f"ids); pin at least {tokenizer_vocab} or drop --vocab-size")
        return pinned, f"pinned by --vocab-size ({pinned})"
    if tokenizer_vocab <= preset_vocab:
        return preset_vocab, f"preset size {preset_vocab} kept (tokenizer has {tokenizer_vocab} ids)"
    rounded = math.ceil(tokenizer_vocab / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return rounded, (f"tokenizer has {tokenizer_vocab} ids > preset {preset_vocab}: using {rounded} "
                     f"(rounded up to a multiple of {VOCAB_MULTIPLE})")


def check_shards_fit_model(manifest: dict[str, Any], where: str, model_config, config) -> None:
    """Refuse (UserError) a shard set whose tokenizer or lengths the model cannot take (the run's
    --input-length / --target-length were checked when `ShardDataset` opened the set)."""
    tok = manifest["tokenizer"]
    vocab = model_config.vocab_size
    for name in ("sentinel_first_id", "sentinel_last_id", "vocab_size"):
        if name not in tok:
            raise UserError(f"{where}: manifest tokenizer section lacks {name}; rebuild with `prep corpus`")
    highest = max(int(tok["sentinel_first_id"]), int(tok["sentinel_last_id"]), int(tok["vocab_size"]) - 1)
    if highest >= vocab:
        raise UserError(f"{where}: token ids reach {highest} (tokenizer of {tok['vocab_size']} ids, sentinels "
                        f"{tok['sentinel_last_id']}..{tok['sentinel_first_id']}) but the model vocabulary is {vocab}; "
                        f"raise --vocab-size to >= {highest + 1} or use a shard set made with a smaller tokenizer")
    for name, model_id in (("pad_id", model_config.pad_token_id), ("eos_id", model_config.eos_token_id)):
        if name in tok and int(tok[name]) != model_id:
            raise UserError(f"{where}: tokenizer {name} is {tok[name]}, the model expects {model_id} (T5 layout); "
                            f"rebuild the tokenizer with `prep tokenizer` and the shards with `prep corpus`")
    if config.tokenizer:
        path = Path(config.tokenizer)
        if not path.is_file():
            raise UserError(f"{path}: --tokenizer file not found; pass the tokenizer.json the shards were made with")
        have = sha256_file(path)
        if have != tok.get("sha256"):
            raise UserError(f"{where}: shards were built with tokenizer sha256 {str(tok.get('sha256'))[:12]}.., "
                            f"but --tokenizer {path} has {have[:12]}..; rebuild the shards with this tokenizer "
                            f"(`prep corpus --tokenizer {path}`) or pass the tokenizer they were made with")
    lengths = manifest["config"]
    for name in ("input_length", "target_length"):
        if int(lengths[name]) < 2:
            raise UserError(f"{where}: {name} {lengths[name]} is too short to train on; rebuild with a longer one")


def device_memory(world_size_local: int) -> dict[str, Any]:
    """The devices this node trains on: GPU name/count/memory, or the host's RAM when there is no GPU."""
    import psutil
    import torch

    host_total = psutil.virtual_memory().total / GIB
    host_available = psutil.virtual_memory().available / GIB
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return {"kind": "cuda", "name": props.name, "count": torch.cuda.device_count(),
                "capability": [props.major, props.minor], "per_device_gib": round(props.total_memory / GIB, 2),
                "host_total_gib": round(host_total, 2),
                "host_available_gib": round(host_available, 2)}
    return {"kind": "cpu", "name": "cpu", "count": world_size_local, "per_device_gib": None,
            "host_total_gib": round(host_total, 2), "host_available_gib": round(host_available, 2)}


def check_fit(estimate: dict[str, Any], device: dict[str, Any], local_world_size: int, force: bool,
              what: str) -> list[str]:
    """Refuse (UserError) when the estimate does not fit; with --force return the reason as a warning."""
    problems = []
    if device["kind"] == "cuda":
        if local_world_size > device["count"]:
            raise UserError(f"{local_world_size} ranks on this node but {device['count']} GPU(s) visible; "
                            f"use --nproc {device['count']} (or fewer)")
        if estimate["per_gpu_gib"] > FIT_FRACTION * device["per_device_gib"]:
            problems.append(f"needs ~{estimate['per_gpu_gib']:.1f} GiB per GPU, {device['name']} has "
                            f"{device['per_device_gib']:.1f} GiB")
        host_need = estimate["per_cpu_gib"]
    else:   # CPU training: the ranks' model states and activations live in host memory too
        host_need = estimate["per_cpu_gib"] + estimate["per_gpu_gib"] * local_world_size
        cores = usable_cores()
        if local_world_size > cores:
            crowded = (f"{local_world_size} CPU ranks on this node but {cores} core(s): each rank would get less than "
                       f"a core and wait on the others (slow; a --rank-timeout may expire)")
            if not force:
                raise UserError(f"{crowded}; use --nproc {cores} or fewer (or --force to run them anyway)")
            problems.append(crowded)
    if host_need > FIT_FRACTION * device["host_available_gib"]:
        problems.append(f"needs ~{host_need:.1f} GiB of host memory on this node, {device['host_available_gib']:.1f}"
                        f" GiB available")
    if problems and not force:
        raise UserError(f"{what} will not fit: {'; '.join(problems)}; try a higher --zero stage, --offload cpu, "
                        f"--activation-checkpointing or a smaller --micro-batch (or --force to try anyway)")
    return problems


def check_run_dir(config) -> None:
    """A fresh run refuses a directory that already holds one (logged steps or complete checkpoints; a launch that
    failed before its first step leaves neither, and its directory is taken again); a resume refuses one whose
    steps were logged but never checkpointed (it would restart at step 0 over them)."""
    from pretrain.checkpoint import latest_complete
    from pretrain.metrics import read_metrics

    run_dir = Path(config.out)
    data = Path(config.data).resolve() if config.data and "://" not in config.data else None
    if data is not None and (run_dir.resolve() == data or data in run_dir.resolve().parents):
        raise UserError(f"{run_dir}: --out is or lies inside --data {config.data}; the run's files would mix with "
                        f"the data; pick a directory of its own")
    if not run_dir.exists():
        return
    if (run_dir / "manifest.json").is_file():
        raise UserError(f"{run_dir}: --out holds a manifest.json (a shard set's); pick a directory of its own")
    checkpointed = latest_complete(run_dir / "checkpoints")
    if not config.resume:
        if read_metrics(run_dir / "metrics.jsonl", events=True) or checkpointed:
            raise UserError(f"{run_dir}: already holds a run (metrics.jsonl / checkpoints); pass --resume to continue "
                            f"it or pick a new --out")
        return
    logged = read_metrics(run_dir / "metrics.jsonl")
    if logged and not checkpointed:
        raise UserError(f"{run_dir}: metrics.jsonl records {len(logged)} steps but there is no complete checkpoint to "
                        f"resume from (the run was launched with --no-save-final or stopped before its first save); "
                        f"pick a new --out to start over, nothing here is changed")


def check_resume_settings(config, plan: Plan, *, announce: bool = True) -> None:
    """--resume: the saved run's settings (RUN_DIR/config.json: train, shard fingerprint, global batch) against
    this launch's, before anything is built; refuses in one line naming what differs and what may."""
    import json

    from pretrain.checkpoint import latest_complete, resume_differences, resume_refusal, step_of

    saved_path = Path(config.out) / "config.json"
    newest = latest_complete(Path(config.out) / "checkpoints") if config.resume else None
    if not config.resume or not saved_path.is_file() or not newest:
        return          # nothing to resume from: the run starts at step 0, whatever the launch before had set
    if config.steps < step_of(newest):
        raise UserError(f"{config.out}: --steps {config.steps} is below step {step_of(newest)}, where the newest "
                        f"checkpoint ({newest}) stands; a resume cannot go back: give --steps >= {step_of(newest)} "
                        f"or pick a new --out")
    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{saved_path}: cannot be read ({type(err).__name__}); it records the run's settings, "
                        f"which --resume compares: restore it or pick a new --out")
    new = {"train": dataclasses.asdict(config), "shard_fingerprint": plan.shard_fingerprint,
           "global_batch": plan.global_batch}
    refused, allowed = resume_differences(saved, new, allow=config.resume_allow)
    if refused:
        raise UserError(resume_refusal(Path(config.out), refused))
    if allowed and announce:
        print(f"[resume] --resume-allow: {'; '.join(allowed)} (applied from the resumed step on)", flush=True)


def run_preflight(config, *, world_size: int, local_world_size: int, announce: bool) -> Plan:
    """All checks in order; prints the plan and the memory table when `announce`."""
    from pretrain.data.modes import describe_data
    from pretrain.model.t5 import load_config, require_fp8

    data = describe_data(config)    # per --loader: the shard set's manifest, or (online) what the source derives
    manifest, where = data["manifest"], data["where"]
    preset = load_config(config.model, **config.model_overrides)
    vocab_size, vocab_note = resolve_vocab_size(preset.vocab_size, int(manifest["tokenizer"]["vocab_size"]),
                                                config.vocab_size)
    model_config = dataclasses.replace(preset, vocab_size=vocab_size,
                                       activation_checkpointing=config.activation_checkpointing)
    check_shards_fit_model(manifest, where, model_config, config)
    grad_accum = config.grad_accum(world_size)
    global_batch = config.resolved_global_batch(world_size)
    if data["num_examples"] is not None and data["num_examples"] < global_batch:
        raise UserError(f"{where}: {data['num_examples']} examples, fewer than one global batch of {global_batch}; "
                        f"use a smaller --global-batch or a larger shard set")
    device = device_memory(local_world_size)
    precision = resolve_precision(config.precision, device["kind"])     # as each rank resolves it
    if precision == "fp8":
        on_cuda = device["kind"] == "cuda"
        require_fp8(device["kind"], device.get("capability"), device["name"] if on_cuda else "this node")
    estimate = estimate_memory(model_config, zero=config.zero, offload=config.offload, precision=precision,
                               world_size=world_size, local_world_size=local_world_size,
                               micro_batch=config.micro_batch, input_length=data["input_length"],
                               target_length=data["target_length"],
                               activation_checkpointing=config.activation_checkpointing,
                               fused_attention=device["kind"] == "cuda")
    what = f"{model_config.name} at ZeRO {config.zero} (offload {config.offload}, micro batch {config.micro_batch})"
    warnings = check_fit(estimate, device, local_world_size, config.force, what)
    plan = Plan(model_config=model_config, vocab_note=vocab_note, input_length=data["input_length"],
                target_length=data["target_length"], num_examples=data["num_examples"] or 0, world_size=world_size,
                grad_accum=grad_accum, global_batch=global_batch, shard_fingerprint=data["fingerprint"],
                tokenizer_sha256=str(manifest["tokenizer"].get("sha256")), device=device,
                memory_estimate=estimate, warnings=warnings)
    check_resume_settings(config, plan, announce=announce)
    if announce:
        print(describe(plan, config, precision), flush=True)
    return plan


def describe(plan: Plan, config, precision: str) -> str:
    """The preflight's printed summary: data, model, batch layout and memory estimate beside the devices."""
    est, dev = plan.memory_estimate, plan.device
    if dev["kind"] == "cuda":
        devices = f"{dev['count']} x {dev['name']} ({dev['per_device_gib']:.1f} GiB each)"
    else:
        devices = f"CPU only, host RAM {dev['host_available_gib']:.1f} / {dev['host_total_gib']:.1f} GiB available"
    lines = [
        f"[preflight] data ({config.loader}): {config.data} ("
        f"{plan.num_examples if config.loader != 'online' else 'made in the loader'} examples, input {plan.input_length}, "
        f"target {plan.target_length}, fingerprint {plan.shard_fingerprint[:12]})",
        f"[preflight] model: {plan.model_config.name}, {est['parameters'] / 1e6:.1f}M params, vocab "
        f"{plan.vocab_note}",
        f"[preflight] batch: {plan.world_size} rank(s) x micro {config.micro_batch} x accum {plan.grad_accum} = "
        f"global {plan.global_batch}; ZeRO {config.zero}, offload {config.offload}, {precision}",
        f"[preflight] memory estimate: {est['per_gpu_gib']:.2f} GiB per device (states {est['model_states_gib']:.2f}"
        f" + activations {est['activations_gib']:.2f}), {est['per_cpu_gib']:.2f} GiB host per node; devices: "
        f"{devices}",
    ]
    if precision == "fp8":
        from pretrain.model.t5 import fp8_bf16_parts
        lines += [f"[preflight] fp8: in bf16, {part}" for part in fp8_bf16_parts(
            plan.model_config, config.micro_batch, plan.input_length, plan.target_length)]
    share = plan.memory_share()
    if dev["kind"] == "cuda" and config.graphs_on(cuda=True, memory_share=share):
        auto = " (auto; --no-cudagraphs: off)" if config.cudagraphs is None else ""
        lines.append(f"[preflight] cudagraphs{auto}: the graphs' private pools come on top of this estimate "
                     "(mt5-large: none through pretrain at micro 32 x 2, 33 GiB for the model alone at batch 64); "
                     "metrics.jsonl's peak_reserved_gib shows them")
    elif dev["kind"] == "cuda" and config.graphs_on(cuda=True):      # auto, off only for the memory
        lines.append(f"[preflight] cudagraphs (auto): off, the estimate fills {share:.0%} of a GPU (auto takes "
                     f"graphs up to {AUTO_GRAPHS_MEMORY_SHARE:.0%}: their private pools come on top of it); "
                     "--cudagraphs asks for them")
    lines += [f"[preflight] WARNING (--force): {warning}" for warning in plan.warnings]
    return "\n".join(lines)
