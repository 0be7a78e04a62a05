"""Decoding speed of a model and its `vaswani export --to ctranslate2` copy, side by side on CPU.

A random Transformer-base (8k vocabulary) is written with `hf_vaswani.interop.export.write_ctranslate2`; both decode
the same 8 sentences of 24 tokens into exactly 24 tokens (greedy and beam 4), repetitions alternating, medians printed.
CTranslate2 runs in a process of its own: its OpenMP runtime and torch's slow each other down in one process.

    python scripts/export_speed.py --threads 2 --repeats 5 [--quantization int8]

Results: docs/deployment.md.
"""

import argparse
import multiprocessing
import statistics
import tempfile
import time

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration, generate
from hf_vaswani.interop.export import write_ctranslate2
from hf_vaswani.kernels.cpu import kernelize
from hf_vaswani.kernels.quantization import quantize_int8

VOCAB, SENTENCES, LENGTH = 8000, 8, 24


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Our special tokens (<pad> 0, <s> 1, </s> 2, <unk> 3) and one made-up word per remaining id."""
    words = ["<pad>", "<s>", "</s>", "<unk>", *(f"w{i}" for i in range(4, VOCAB))]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def serve_ctranslate2(connection, folder: str, compute_type: str, threads: int) -> None:
    import ctranslate2

    translator = ctranslate2.Translator(folder, compute_type=compute_type, intra_threads=threads, inter_threads=1)
    while (request := connection.recv()) is not None:
        tokens, beams = request
        start = time.perf_counter()
        results = translator.translate_batch(
            tokens, beam_size=beams, min_decoding_length=LENGTH, max_decoding_length=LENGTH
        )
        connection.send((time.perf_counter() - start, [result.hypotheses[0] for result in results]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quantization", default="float32", help="CTranslate2 weights and compute type")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = kernelize(VaswaniForConditionalGeneration(VaswaniConfig.base(vocab_size=VOCAB))).eval()
    tokenizer = word_tokenizer()
    source = torch.cat([torch.randint(4, VOCAB, (SENTENCES, LENGTH - 1)), torch.full((SENTENCES, 1), 2)], dim=1)
    tokens = [tokenizer.convert_ids_to_tokens(row) for row in source.tolist()]
    folder = tempfile.mkdtemp()
    write_ctranslate2(model, tokenizer, folder, args.quantization)
    if args.quantization.startswith("int8"):
        model = quantize_int8(model)  # torch dynamic int8, against CTranslate2's int8
    connection, child = multiprocessing.get_context("spawn").Pipe()
    server = multiprocessing.get_context("spawn").Process(
        target=serve_ctranslate2, args=(child, folder, args.quantization, args.threads)
    )
    server.start()
    child.close()  # so that a crash of the server ends recv() here with EOFError instead of a wait
    options = dict(min_new_tokens=LENGTH, max_new_tokens=LENGTH, length_penalty_type="power")
    for beams in (1, 4):
        times: dict[str, list[float]] = {"hf_vaswani": [], "CTranslate2": []}
        for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
            start = time.perf_counter()
            with torch.inference_mode():
                ours = generate(model, source, num_beams=beams, max_new_tokens_over_source=None, **options)
            elapsed = time.perf_counter() - start
            connection.send((tokens, beams))
            ct2_seconds, hypotheses = connection.recv()
            if repeat:
                times["hf_vaswani"].append(elapsed)
                times["CTranslate2"].append(ct2_seconds)
        same = (ours[:, 1:] == torch.tensor([tokenizer.convert_tokens_to_ids(h) for h in hypotheses])).float().mean()
        speeds = {name: SENTENCES * LENGTH / statistics.median(values) for name, values in times.items()}
        print(
            f"beam {beams}: hf_vaswani {speeds['hf_vaswani']:.1f} tok/s, CTranslate2 {args.quantization} "
            f"{speeds['CTranslate2']:.1f} tok/s, ratio {speeds['hf_vaswani'] / speeds['CTranslate2']:.2f}; "
            f"same output tokens {same:.1%}"
        )
    connection.send(None)
    server.join()


if __name__ == "__main__":
    main()
