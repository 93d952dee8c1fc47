"""`train` against torchtitan 0.3.0's own components, side by side: tokens per second, the
trainer's own time per step, and peak memory per rank (docs/development/benchmarks.md,
"The trainer").

usage: train_bench.py TRAIN_BINARY [--reps N] [--steps N] [--out FILE.jsonl]

For each configuration (torchtitan's debugmodel dimensions at seq_len 512 and local batch 1 on 4
processes, FSDP without, with selective and with full activation checkpointing, and FSDP + TP;
and a tiny model as a second row), each repetition runs ours
(TRAIN_BINARY, 4 processes with the torchrun environment, Gloo) and the reference
(train/testdata/torchtitan_reference.py with "measure": torchtitan's Llama3Model,
parallelize_llama, loss and schedule in its Trainer.train_step, 4 processes, Gloo), in
alternating order, on the same windows of the shipped corpus, one intra-op thread per process
on both sides. A step's time is rank 0's wall time of the step (ours: metrics'
time_metrics/end_to_end(s) at log_freq 1; theirs: around its train_step); tokens per second =
global batch tokens / the median step time over steps 3.. (the first two: warm-up and the
optimizer's state). Memory: the largest rank's LibTorch CPU allocation peak over steps 2..,
counted alike (metrics/allocation_window.h; tests/peer/peer_common.py AllocationWindow).
Ours also reports the median non-model time of a step (data loading, token counts, loss
reductions, the loop), from time_metrics/non_model(s). Prints one line per configuration and
the ratios; appends JSON lines to --out.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WORLD = 4
DEBUGMODEL = dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048)
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048)
# ac: activation checkpointing on both sides ("none" unless given): torchtitan's SelectiveAC /
# FullAC and ours (activation_checkpoint.mode).
CONFIGS = [
    ("debugmodel fsdp4", dict(DEBUGMODEL, tp=1, seq_len=512, local_batch_size=1)),
    ("debugmodel fsdp4 selective AC", dict(DEBUGMODEL, tp=1, seq_len=512, local_batch_size=1, ac="selective")),
    ("debugmodel fsdp4 full AC", dict(DEBUGMODEL, tp=1, seq_len=512, local_batch_size=1, ac="full")),
    ("debugmodel fsdp2 x tp2", dict(DEBUGMODEL, tp=2, seq_len=512, local_batch_size=1)),
    ("tiny fsdp4", dict(TINY, tp=1, seq_len=128, local_batch_size=2)),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def global_batch(c):
    return c["local_batch_size"] * WORLD // c["tp"]


def ours(binary, c, steps, tmp):
    dump = os.path.join(tmp, "ours")
    args = [binary, "--config", "train/configs/debugmodel.toml",
            f"--model.dim={c['dim']}", f"--model.n_layers={c['n_layers']}", f"--model.n_heads={c['n_heads']}",
            f"--model.n_kv_heads={c['n_kv_heads']}", f"--model.vocab_size={c['vocab_size']}",
            f"--training.seq_len={c['seq_len']}", f"--training.local_batch_size={c['local_batch_size']}",
            f"--training.global_batch_size={global_batch(c)}", f"--training.steps={steps}",
            "--training.mixed_precision_param=float32", f"--activation_checkpoint.mode={c.get('ac', 'none')}",
            f"--parallelism.tensor_parallel_degree={c['tp']}", "--validator.enable=false", "--metrics.log_freq=1",
            "--metrics.enable_jsonl=true", "--metrics.save_for_all_ranks=true", f"--dump_folder={dump}"]
    port = free_port()
    procs = []
    for r in range(WORLD):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(WORLD),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    errors = [p.communicate()[1].decode() for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("train failed:\n" + "\n".join(errors))
    rows = []
    for r in range(WORLD):
        path = os.path.join(dump, "metrics.jsonl" + ("" if r == 0 else f".rank{r}"))
        with open(path) as f:
            rows.append([json.loads(line) for line in f if "loss_metrics/global_avg_loss" in line])
    step_seconds = [row["time_metrics/end_to_end(s)"] for row in rows[0]]
    non_model = [row["time_metrics/non_model(s)"] for row in rows[0]]
    # The largest rank's peak over steps 2.. (each line: the peak since the previous log).
    peak = max(row["memory/max_reserved(GiB)"] for rank in rows for row in rank[1:]) * 2**30
    return statistics.median(step_seconds[2:]), statistics.median(non_model[2:]), peak


def theirs(python, c, steps, tmp):
    spec = dict(c, world=WORLD, dp_replicate=1, sp=True, steps=steps, global_batch_size=global_batch(c), lr=8e-4,
                warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0, max_norm=1.0,
                ac=c.get("ac", "none"),
                dataset="train/testdata/corpus/train", seed=0, measure=True)
    spec_path, out = os.path.join(tmp, "spec.json"), os.path.join(tmp, "theirs")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    subprocess.run([python, "train/testdata/torchtitan_reference.py", spec_path, out], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
    import torch  # the peer venv's
    ref = torch.load(os.path.join(out, "reference.pt"))
    return statistics.median(ref["step_seconds"].tolist()[2:]), float(ref["peak_bytes"][0])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("train_binary")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "train.jsonl"))
    parser.add_argument("--only", help="run the configurations whose name contains this")
    a = parser.parse_args()
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    print(f"{'configuration':24} {'ours tok/s':>11} {'tt tok/s':>9} {'ratio':>6} {'non-model':>10} "
          f"{'ours MiB':>9} {'tt MiB':>7} {'mem ratio':>9}")
    for name, c in CONFIGS:
        if a.only and a.only not in name:
            continue
        tokens = global_batch(c) * c["seq_len"]
        ratios, ours_s, theirs_s, non_model, ours_peak, theirs_peak = [], [], [], [], 0, 0
        for rep in range(a.reps):
            with tempfile.TemporaryDirectory() as tmp:
                order = [0, 1] if rep % 2 == 0 else [1, 0]
                for side in order:
                    if side == 0:
                        s, nm, peak = ours(a.train_binary, c, a.steps, tmp)
                        ours_s.append(s)
                        non_model.append(nm)
                        ours_peak = max(ours_peak, peak)
                    else:
                        s, peak = theirs(sys.executable, c, a.steps, tmp)
                        theirs_s.append(s)
                        theirs_peak = max(theirs_peak, peak)
            ratios.append(theirs_s[-1] / ours_s[-1])
        ratio = statistics.median(ratios)
        o, t = tokens / statistics.median(ours_s), tokens / statistics.median(theirs_s)
        nm = statistics.median(non_model)
        print(f"{name:24} {o:11.0f} {t:9.0f} {ratio:6.2f} {1e3 * nm:8.2f}ms {ours_peak / 2**20:9.1f} "
              f"{theirs_peak / 2**20:7.1f} {ours_peak / theirs_peak:9.2f}")
        with open(a.out, "a") as f:
            f.write(json.dumps({"config": name, "ours_tokens_per_s": o, "torchtitan_tokens_per_s": t,
                                "speed_ratio": ratio, "speed_ratios": ratios,
                                "ours_non_model_s": nm, "ours_step_s": statistics.median(ours_s),
                                "ours_peak_bytes": ours_peak, "torchtitan_peak_bytes": theirs_peak,
                                "memory_ratio": ours_peak / theirs_peak}) + "\n")


if __name__ == "__main__":
    main()
