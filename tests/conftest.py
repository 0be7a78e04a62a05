import os

import pytest
import torch

# Nothing may download at run time: any attempt to reach the Hub fails loudly instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

torch.set_num_threads(1)


@pytest.fixture
def tiny_config_kwargs() -> dict:
    """A model small enough for CPU tests, with d_k != d_v so that both paths of §3.2.2 are exercised."""
    return dict(
        vocab_size=61,
        d_model=24,
        d_ff=40,
        num_heads=3,
        d_k=6,
        d_v=10,
        encoder_layers=2,
        decoder_layers=2,
        dropout=0.0,
    )


WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "house", "river"]


def reversal_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    """A toy translation task: the target is the source in capitals (a new vocabulary, aligned word by word)."""
    import random

    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 4))]
        pairs.append((" ".join(words), " ".join(w.upper() for w in words)))
    return pairs


@pytest.fixture(scope="session")
def trained_folder(tmp_path_factory):
    """A small model really trained (a few seconds) on the toy task, saved as a Hub-ready folder."""
    from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration, save_model_folder
    from hf_vaswani.tokenization import train_shared_bpe

    pairs = reversal_pairs(2000, seed=0)
    tokenizer = train_shared_bpe([text for pair in pairs for text in pair], vocab_size=300, min_frequency=1)
    torch.manual_seed(0)
    config = VaswaniConfig(
        vocab_size=len(tokenizer),
        d_model=64,
        d_ff=128,
        num_heads=4,
        encoder_layers=2,
        decoder_layers=2,
        dropout=0.0,
        label_smoothing=0.0,
    )
    model = VaswaniForConditionalGeneration(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98), eps=1e-9)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 50))
    generator = torch.Generator().manual_seed(0)
    for _ in range(600):
        batch = [pairs[i] for i in torch.randint(len(pairs), (32,), generator=generator)]
        inputs = tokenizer([s for s, _ in batch], text_target=[t for _, t in batch], return_tensors="pt", padding=True)
        inputs["labels"] = inputs["labels"].masked_fill(inputs["labels"] == tokenizer.pad_token_id, -100)
        loss = model(**inputs).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        warmup.step()
    folder = tmp_path_factory.mktemp("trained") / "capitaliser"
    save_model_folder(model.eval(), tokenizer, folder)
    return folder
