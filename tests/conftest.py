import getpass
import os
import tempfile
from pathlib import Path

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

# Nothing may download at run time: any attempt to reach the Hub fails loudly instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# inductor's on-disk cache is not keyed on the kernel selection, and code compiled under one selection breaks under
# another (.ci/run tests under two): one cache for each selection.
KERNEL_SELECTION = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    selection = "-".join(os.environ.get(name, "native") for name in KERNEL_SELECTION)
    cache = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}-{selection}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)

torch.set_num_threads(1)


def train_capitaliser(max_steps: int):
    """Train on the toy task until the criterion holds, checked every CAPITALISER_TRAINING["check_every"] steps:
    (model, tokenizer, steps).

    Float results differ between CPUs (MKL, oneDNN and ATen pick kernels by instruction set), so the same number of
    steps ends at a different model on each: training runs to a checked criterion instead.
    """
    from helpers import DECODING_PATHS, LOGIT_MARGIN, mistranslations, smallest_logit_margin
    from tiny import CAPITALISER_MODEL, CAPITALISER_TRAINING, PROBE_SENTENCES, capitalised_pairs

    from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration
    from hf_vaswani.data.tokenization import train_shared_bpe
    from hf_vaswani.model.generation_vaswani import paper_generation_config

    probe = set(PROBE_SENTENCES)
    pairs = [pair for pair in capitalised_pairs(20000, seed=0) if pair[0] not in probe]
    # 400 leaves room for every word, lower and upper case, as one token: outputs of at most 5 tokens, short enough
    # for beam search's early stop not to end on a wrong hypothesis that finished first.
    tokenizer = train_shared_bpe([text for pair in pairs for text in pair], vocab_size=400, min_frequency=1)
    torch.manual_seed(0)
    config = VaswaniConfig(vocab_size=len(tokenizer), **CAPITALISER_MODEL)
    model = VaswaniForConditionalGeneration(config)
    model.generation_config = paper_generation_config(config)  # §6.1 decoding by default, as `vaswani train` saves
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98), eps=1e-9)
    # Warm up for 50 steps, then halve the rate every 200: with batches of 32 sentences the weights keep jumping
    # at a constant rate, and the exponential average below smooths what is left (the paper averages checkpoints).
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / 50, 0.5 ** ((step - 50) / 200))
    )
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.98))
    generator = torch.Generator().manual_seed(0)
    margin = -torch.inf
    for step in range(1, max_steps + 1):
        batch = [pairs[i] for i in torch.randint(len(pairs), (32,), generator=generator)]
        inputs = tokenizer([s for s, _ in batch], text_target=[t for _, t in batch], return_tensors="pt", padding=True)
        inputs["labels"] = inputs["labels"].masked_fill(inputs["labels"] == tokenizer.pad_token_id, -100)
        loss = model(**inputs).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        averaged.update_parameters(model)
        if step % CAPITALISER_TRAINING["check_every"] == 0:
            candidate = averaged.module.eval()
            margin = smallest_logit_margin(candidate, tokenizer, PROBE_SENTENCES)
            # The margin makes greedy decoding right; beam search is checked as well, since with early stopping it
            # can end on wrong hypotheses that finished first.
            if margin >= LOGIT_MARGIN and not any(
                mistranslations(candidate, tokenizer, PROBE_SENTENCES, **options) for options in DECODING_PATHS.values()
            ):
                return candidate, tokenizer, step
    pytest.fail(
        f"the toy model did not learn the task in {max_steps} steps: smallest logit margin on the probe sentences "
        f"{margin:.2f} (wanted >= {LOGIT_MARGIN}, with every probe sentence translated right)"
    )


@pytest.fixture(scope="session")
def trained_folder(tmp_path_factory):
    """A small model really trained (seconds) on the toy task until it meets its criterion, as a Hub folder.

    Tests may rely on what the criterion checks: every PROBE_SENTENCES sentence translates to its capitalised form
    with each of DECODING_PATHS, with a LOGIT_MARGIN to spare on every token.
    """
    from tiny import CAPITALISER_TRAINING

    from hf_vaswani import save_model_folder

    model, tokenizer, steps = train_capitaliser(CAPITALISER_TRAINING["max_steps"])
    print(f"trained_folder: the criterion held after {steps} steps")  # shown with -s, or -rP
    folder = tmp_path_factory.mktemp("trained") / "capitaliser"
    save_model_folder(model, tokenizer, folder)
    return folder
