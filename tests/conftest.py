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
