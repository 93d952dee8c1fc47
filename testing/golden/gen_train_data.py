"""Golden trainer corpus from real torchtitan: document packing into training windows.

Run with the peer venv's python (`./x golden` does; the peer venv has torchtitan 0.3.0 and
`datasets`, which torchtitan's text_datasets imports). Writes

  train/testdata/golden_train_data.txt   read by train/data_test.cc

torchtitan's own HuggingFaceTextDataset (torchtitan/hf_datasets/text_datasets.py) runs with
infinite=True, dp_world_size=1, over a map-style datasets.Dataset registered in its DATASETS
table (its documented extension point, "Add your dataset here"); nothing of its packing is
re-implemented here. Two corpora:

  * the shipped corpus (train/testdata/corpus): its text files split into documents as
    tools/prepare_data.py splits them, encoded by torchtitan's HuggingFaceTokenizer over the
    shipped tokenizer, so the windows also check the token files prepare_data.py wrote;
  * synthetic documents of given ids (lengths 0..2 included: a tokenizer never returns them,
    our reader accepts them), encoded by a fake tokenizer that returns them as they are.

One change to torchtitan's behaviour: its re-loop shuffles with datasets' Dataset.shuffle(seed=
42 + epoch); that is replaced by the order torch.randperm(n, generator=torch.Generator()
.manual_seed(seed)) gives, the documented order of train/dataloader.h. Epoch 0 is unshuffled,
as torchtitan's. Regenerating reproduces the file byte for byte.
"""

import os
import sys
import time

import datasets
import golden_common as gc
import torch
import torchtitan
import torchtitan.hf_datasets.text_datasets as td
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets import DatasetConfig

sys.path.insert(0, os.path.join(gc.REPO_ROOT, "tools"))
import prepare_data  # noqa: E402  (the document split of the token files)

GOLDEN = "train/testdata/golden_train_data.txt"
CORPUS = "train/testdata/corpus"
SEED = 42  # torchtitan's re-loop seed base; train/dataloader.h's default
FIRST_WINDOWS = 6
MAX_EPOCH = 2  # windows around each epoch boundary up to this one

DOC = f"""
torchtitan {torchtitan.__version__}'s HuggingFaceTextDataset packing (testing/golden/gen_train_data.py);
fields tab-separated, integer lists comma-separated (`-`: empty).
  dataset <name> <prefix>|synthetic <tokens_per_epoch>   a corpus; T = sum(len(doc) - 1)
  doc <ids>                        a synthetic dataset's documents, in order (vocab 64, bos 0, eos 1)
  order <epoch> <doc ids>          the epoch's document order: torch.randperm(n, manual_seed({SEED} + epoch))
  stream <seq_len>                 torchtitan's windows of the last dataset at this seq_len:
  window <k> <epoch> <input> <labels> <positions>   the k-th window it yielded (0-based) and
                                   the epoch of its first token, k * seq_len // T
Windows: the first {FIRST_WINDOWS}, and the three around the start of each epoch 1..{MAX_EPOCH}.
"""

SYNTHETIC = [
    [0, 5, 6, 7, 1],
    [],
    [0, 1],
    [9],
    [0, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 1],
    [0, 30, 1],
    [0, 31, 32, 33, 34, 35, 36, 37, 1],
    [0, 40, 41, 1],
    [0, 1],
    [0, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 1],
    [0, 2, 1],
    [0, 3, 4, 1],
]


class FakeTokenizer:
    """encode() of a synthetic document's name: its ids as given (BOS/EOS already in them)."""

    def __init__(self, docs):
        self.docs = docs

    def encode(self, text, add_bos=True, add_eos=True):
        assert add_bos and add_eos
        return list(self.docs[int(text)])


def randperm_shuffle(self, seed=None, **kwargs):
    """Dataset.shuffle as train/dataloader.h orders an epoch."""
    perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
    return self.select(perm.tolist())


def register(name, texts):
    td.DATASETS[name] = DatasetConfig(
        path=name,
        loader=lambda path: datasets.Dataset.from_dict({"text": texts}),
        sample_processor=lambda sample: sample["text"],
    )


def record_stream(golden, name, tokenizer, seq_len, tokens_per_epoch):
    golden.add(f"stream\t{seq_len}")
    ds = td.HuggingFaceTextDataset(name, None, tokenizer, seq_len=seq_len, infinite=True)
    wanted = set(range(FIRST_WINDOWS))
    for epoch in range(1, MAX_EPOCH + 1):
        boundary = epoch * tokens_per_epoch // seq_len
        wanted |= {max(boundary - 1, 0), boundary, boundary + 1}
    last = max(wanted)
    for k, (inputs, labels) in enumerate(ds):
        if k in wanted:
            golden.add(
                "\t".join(
                    [
                        "window",
                        str(k),
                        str(k * seq_len // tokens_per_epoch),
                        gc.ints(inputs["input"]),
                        gc.ints(labels),
                        gc.ints(inputs["positions"]),
                    ]
                )
            )
            golden.records += 1
        if k == last:
            break


def main():
    gc.quiet_torch()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    td.logger.disabled = True
    datasets.Dataset.shuffle = randperm_shuffle
    start = time.time()
    golden = gc.GoldenFile(GOLDEN, DOC)

    # The synthetic documents.
    register("fsdp_synthetic", [str(i) for i in range(len(SYNTHETIC))])
    tokens = sum(max(len(d) - 1, 0) for d in SYNTHETIC)
    golden.add(f"dataset\tsynthetic\tsynthetic\t{tokens}")
    for d in SYNTHETIC:
        golden.add("doc\t" + gc.ints(d))
    for epoch in range(1, MAX_EPOCH + 1):
        perm = torch.randperm(len(SYNTHETIC), generator=torch.Generator().manual_seed(SEED + epoch))
        golden.add(f"order\t{epoch}\t{gc.ints(perm)}")
    fake = FakeTokenizer(SYNTHETIC)
    for seq_len in (1, 2, 3, 5, 8, 13, 64):
        record_stream(golden, "fsdp_synthetic", fake, seq_len, tokens)

    # The shipped corpus, from its text (the README names the files of each split).
    tokenizer = HuggingFaceTokenizer(tokenizer_path=os.path.join(gc.REPO_ROOT, CORPUS, "tokenizer"))
    text_dir = os.path.join(gc.REPO_ROOT, CORPUS, "text")
    validation = ["MPL-2.0.txt"]
    splits = {
        "train": sorted(f for f in os.listdir(text_dir) if f.endswith(".txt") and f not in validation),
        "validation": validation,
    }
    for split, seq_lens in (("train", (16, 64, 257)), ("validation", (1, 128))):
        texts = list(prepare_data.read_documents([os.path.join(text_dir, f) for f in splits[split]]))
        register(f"fsdp_corpus_{split}", texts)
        tokens = sum(len(tokenizer.encode(t, add_bos=True, add_eos=True)) - 1 for t in texts)
        golden.add(f"dataset\t{split}\t{CORPUS}/{split}\t{tokens}")
        for seq_len in seq_lens:
            record_stream(golden, f"fsdp_corpus_{split}", tokenizer, seq_len, tokens)

    golden.write()
    print(
        f"gen_train_data.py: {time.time() - start:.1f} s with torch {torch.__version__}, "
        f"torchtitan {torchtitan.__version__}"
    )


if __name__ == "__main__":
    main()
