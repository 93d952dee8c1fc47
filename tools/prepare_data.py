"""Prepares a training corpus for the C++ trainer: a tokenizer, and token files.

Run with the peer venv's python (~/.cache/libtorch-fsdp/peer-venv-torch-<version>/bin/python:
it has torchtitan, `tokenizers` and `datasets`).

  prepare_data.py train-tokenizer --input FILE... --vocab-size N --output DIR
      Trains a byte-level BPE tokenizer (HF `tokenizers`) on the documents of the inputs and
      writes DIR/tokenizer.json and DIR/tokenizer_config.json, with the special tokens
      <|begin_of_text|> (BOS) and <|end_of_text|> (EOS) inside the N ids, as torchtitan's
      HuggingFaceTokenizer loads them.

  prepare_data.py tokenize --tokenizer DIR|tokenizer.json --input FILE... --output PREFIX
                           [--hf-dataset NAME [--hf-split S] [--hf-text-field F]]
      Encodes every document as tokenizer.encode(text, add_bos=True, add_eos=True) and writes
      PREFIX.index + PREFIX.tokens (docs/guide/data_format.md; train/token_dataset.h reads them).

Documents: a `.jsonl` input has one JSON object a line, its "text" field a document; any other
input is UTF-8 text, one document per paragraph: a maximal run of lines that are not blank
(empty or whitespace only), joined with "\\n", without the final newline. Documents come in
input order, then file order; --hf-dataset NAME appends the split's rows (needs `datasets`
and its data: no download happens here unless the dataset is fetched by `datasets` itself).

The tokenizer: a directory with tokenizer.json and tokenizer_config.json (or a tokenizer.json
next to one) is loaded with torchtitan's own HuggingFaceTokenizer, whose encode adds BOS/EOS
from tokenizer_config.json's bos_token/eos_token (unless the tokenizer adds them itself), as
torchtitan's HuggingFaceTextDataset calls it. A lone tokenizer.json without a config is loaded
with `tokenizers`: the ids are [BOS] + encode(text, add_special_tokens=False).ids + [EOS], BOS
and EOS the ids of --bos-token / --eos-token (defaults above), which must be in its vocab.

Output is deterministic: the same inputs and tokenizer give the same bytes (no timestamps; the
BPE trainer runs single-threaded and breaks ties by its own fixed order).
"""

import argparse
import array
import json
import os
import struct
import sys

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"

MAGIC = b"FSDPTOKS"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQQQQ")  # magic, version, token_bytes, vocab, bos, eos, n_docs, n_tokens, reserved


def paragraphs(text):
    """The documents of a text file: maximal runs of non-blank lines, joined with '\\n'."""
    docs, current = [], []
    for line in text.split("\n"):
        if line.strip():
            current.append(line.rstrip("\r"))
        elif current:
            docs.append("\n".join(current))
            current = []
    if current:
        docs.append("\n".join(current))
    return docs


def read_documents(paths):
    for path in paths:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                        sys.exit(f"prepare_data: {path}:{n}: no string \"text\" field")
                    yield row["text"]
        else:
            with open(path, encoding="utf-8") as f:
                yield from paragraphs(f.read())


def hf_documents(name, split, field):
    try:
        import datasets
    except ImportError:
        sys.exit("prepare_data: --hf-dataset needs the `datasets` package")
    for row in datasets.load_dataset(name, split=split):
        yield row[field]


class Encoder:
    """encode(text) -> ids with BOS and EOS, and the vocab size / BOS / EOS ids."""

    def __init__(self, path, bos_token, eos_token):
        directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        if os.path.isfile(os.path.join(directory, "tokenizer_config.json")) and (
            os.path.isdir(path) or os.path.basename(path) == "tokenizer.json"
        ):
            from torchtitan.components.tokenizer import HuggingFaceTokenizer

            tok = HuggingFaceTokenizer(tokenizer_path=directory)
            if tok.bos_id is None or tok.eos_id is None:
                sys.exit(f"prepare_data: {directory}/tokenizer_config.json names no bos_token/eos_token")
            self.encode = lambda text: tok.encode(text, add_bos=True, add_eos=True)
            self.vocab_size, self.bos_id, self.eos_id = tok.get_vocab_size(), tok.bos_id, tok.eos_id
            self.kind = f"torchtitan HuggingFaceTokenizer({directory})"
            return
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        tok = Tokenizer.from_file(file)
        bos, eos = tok.token_to_id(bos_token), tok.token_to_id(eos_token)
        if bos is None or eos is None:
            sys.exit(f"prepare_data: {file} has no token {bos_token!r} or {eos_token!r} (--bos-token/--eos-token)")
        self.encode = lambda text: [bos] + tok.encode(text, add_special_tokens=False).ids + [eos]
        self.vocab_size, self.bos_id, self.eos_id = tok.get_vocab_size(), bos, eos
        self.kind = f"tokenizers.Tokenizer({file})"


def write_dataset(prefix, docs, vocab_size, bos_id, eos_id):
    """PREFIX.index + PREFIX.tokens (train/token_dataset.h); returns (documents, tokens)."""
    token_bytes = 2 if vocab_size <= 65536 else 4
    tokens = array.array("H" if token_bytes == 2 else "I")
    assert tokens.itemsize == token_bytes
    offsets = array.array("Q", [0])
    for d, ids in enumerate(docs):
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            sys.exit(f"prepare_data: document {d} has token id {bad[0]} outside the vocab of {vocab_size}")
        tokens.extend(ids)
        offsets.append(len(tokens))
    if sys.byteorder != "little":
        tokens.byteswap()
        offsets.byteswap()
    header = HEADER.pack(MAGIC, VERSION, token_bytes, vocab_size, bos_id, eos_id, len(offsets) - 1, len(tokens), 0)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    for suffix, data in ((".tokens", tokens.tobytes()), (".index", header + offsets.tobytes())):
        tmp = prefix + suffix + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, prefix + suffix)
    return len(offsets) - 1, len(tokens)


def cmd_tokenize(args):
    enc = Encoder(args.tokenizer, args.bos_token, args.eos_token)
    texts = list(read_documents(args.input))
    if args.hf_dataset:
        texts += list(hf_documents(args.hf_dataset, args.hf_split, args.hf_text_field))
    n_docs, n_tokens = write_dataset(args.output, (enc.encode(t) for t in texts), enc.vocab_size, enc.bos_id,
                                     enc.eos_id)
    print(f"prepare_data: {args.output}.index/.tokens: {n_docs} documents, {n_tokens} tokens, vocab "
          f"{enc.vocab_size} (bos {enc.bos_id}, eos {enc.eos_id}) with {enc.kind}")


def cmd_train_tokenizer(args):
    # One thread: the trainer's counts are merged in a fixed order then (reproducible bytes).
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(read_documents(args.input)), trainer=trainer)
    if tok.get_vocab_size() != args.vocab_size:
        print(f"prepare_data: the corpus gave {tok.get_vocab_size()} ids, not {args.vocab_size}", file=sys.stderr)
    os.makedirs(args.output, exist_ok=True)
    tok.save(os.path.join(args.output, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
    }
    with open(os.path.join(args.output, "tokenizer_config.json"), "w", encoding="utf-8", newline="\n") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"prepare_data: {args.output}/tokenizer.json: byte-level BPE, {tok.get_vocab_size()} ids "
          f"({BOS_TOKEN} = {tok.token_to_id(BOS_TOKEN)}, {EOS_TOKEN} = {tok.token_to_id(EOS_TOKEN)})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tokenize", help="encode documents into PREFIX.index + PREFIX.tokens")
    t.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json (+ tokenizer_config.json)")
    t.add_argument("--input", nargs="*", default=[], help="text files (a document per paragraph) or .jsonl")
    t.add_argument("--hf-dataset", help="also a Hugging Face dataset's rows (needs `datasets`)")
    t.add_argument("--hf-split", default="train")
    t.add_argument("--hf-text-field", default="text")
    t.add_argument("--bos-token", default=BOS_TOKEN, help="without tokenizer_config.json only")
    t.add_argument("--eos-token", default=EOS_TOKEN, help="without tokenizer_config.json only")
    t.add_argument("--output", required=True, help="PREFIX of PREFIX.index and PREFIX.tokens")
    t.set_defaults(run=cmd_tokenize)
    b = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer")
    b.add_argument("--input", nargs="+", required=True)
    b.add_argument("--vocab-size", type=int, required=True)
    b.add_argument("--output", required=True, help="directory for tokenizer.json + tokenizer_config.json")
    b.set_defaults(run=cmd_train_tokenizer)
    args = parser.parse_args(argv)
    if args.command == "tokenize" and not args.input and not args.hf_dataset:
        parser.error("tokenize needs --input or --hf-dataset")
    args.run(args)


if __name__ == "__main__":
    main()
