"""transformers' own model test suite (ModelTesterMixin, GenerationTesterMixin, ConfigTester) run on this model.

The mixins are transformers' test files, kept verbatim in ../shared/hf_common_tests (see its README); this file is the
tester and adapter glue that every model inside transformers has, modelled on tests/models/marian/. Without that
folder this file is skipped with the reason, and fails under CI (the environment variable CI set), where a run that
lost these tests must not look green.
"""

import os
import sys
import tempfile
import unittest
from pathlib import Path

import pytest
import torch
import torch._inductor.config

HF_COMMON_TESTS = Path(__file__).resolve().parents[3] / "shared" / "hf_common_tests"


def not_run(reason: str) -> None:
    """Skip this file with `reason`, or fail it under CI, which must run these tests."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"{reason}; CI runs transformers' common model tests", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


if not (HF_COMMON_TESTS / "tests" / "test_modeling_common.py").is_file():
    not_run(f"transformers' common model tests are not at {HF_COMMON_TESTS}")


def import_transformers_tests():
    """Their package is named `tests`, like our folder: a regular package (theirs has __init__.py) found anywhere on
    sys.path wins over a folder without one (ours), so putting theirs on the path is enough, unless another `tests`
    was imported first."""
    loaded = sys.modules.get("tests")
    if loaded is not None and Path(loaded.__path__[0]).resolve() != HF_COMMON_TESTS / "tests":
        not_run(f"another `tests` package ({loaded.__path__[0]}) is imported already")
    if str(HF_COMMON_TESTS) not in sys.path:
        sys.path.append(str(HF_COMMON_TESTS))
    import tests.generation.test_utils as generation_tests
    import tests.test_modeling_common as modeling_tests
    from tests.test_configuration_common import ConfigTester

    return generation_tests, modeling_tests, ConfigTester


generation_tests, modeling_tests, ConfigTester = import_transformers_tests()
GenerationTesterMixin, ModelTesterMixin, ids_tensor = (
    generation_tests.GenerationTesterMixin,
    modeling_tests.ModelTesterMixin,
    modeling_tests.ids_tensor,
)

from transformers.models.auto import modeling_auto  # noqa: E402

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration, VaswaniModel  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def listed_as_a_transformers_model():
    """The mixins find a base model and a seq2seq LM head in transformers' built-in name tables only."""
    additions = [
        (modeling_auto.MODEL_MAPPING_NAMES, "VaswaniModel"),
        (modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, "VaswaniForConditionalGeneration"),
    ]
    for names, class_name in additions:
        names["vaswani"] = class_name
    yield
    for names, _ in additions:
        del names["vaswani"]


class VaswaniModelTester:
    """Marian's tester with this model's config: tiny, dropout on (the mixins check eval mode turns it off)."""

    def __init__(self, parent, batch_size=13, seq_length=7, vocab_size=99, is_training=True):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.is_training = is_training
        self.hidden_size = 16
        self.num_hidden_layers = 2
        self.num_attention_heads = 4
        self.eos_token_id, self.pad_token_id, self.bos_token_id, self.decoder_start_token_id = 2, 1, 0, 3

    def get_config(self) -> VaswaniConfig:
        return VaswaniConfig(
            vocab_size=self.vocab_size,
            d_model=self.hidden_size,
            d_ff=4,
            num_heads=self.num_attention_heads,
            encoder_layers=self.num_hidden_layers,
            decoder_layers=self.num_hidden_layers,
            dropout=0.1,
            attention_dropout=0.1,
            max_position_embeddings=100,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id,
            decoder_start_token_id=self.decoder_start_token_id,
        )

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size).clamp(3)
        input_ids[:, -1] = self.eos_token_id
        decoder_input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = input_ids.ne(self.pad_token_id)
        inputs = {
            "input_ids": input_ids,
            "decoder_input_ids": decoder_input_ids,
            "attention_mask": attention_mask,
            "decoder_attention_mask": attention_mask,
        }
        return self.get_config(), inputs

    def prepare_config_and_inputs_for_common(self):
        return self.prepare_config_and_inputs()


class VaswaniModelTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (VaswaniModel, VaswaniForConditionalGeneration)
    is_encoder_decoder = True
    test_missing_keys = False

    def setUp(self):
        self.model_tester = VaswaniModelTester(self)
        self.config_tester = ConfigTester(self, config_class=VaswaniConfig, d_model=16, num_heads=4)

    def test_config(self):
        self.config_tester.run_common_tests()

    # inductor's vectorized C++ for the compiled static-cache decoding step corrupts memory on AVX-512 CPUs, for
    # transformers' own MarianMTModel as well; its scalar code (cpp.simdlen=1) does not. The mixin test runs unchanged.
    def test_generate_compile_model_forward_fullgraph(self):
        with torch._inductor.config.patch({"cpp.simdlen": 1}):
            super().test_generate_compile_model_forward_fullgraph()

    def test_save_load_strict(self):
        config, _ = self.model_tester.prepare_config_and_inputs()
        for model_class in self.all_model_classes:
            model = model_class(config)
            with tempfile.TemporaryDirectory() as folder:
                model.save_pretrained(folder)
                _, info = model_class.from_pretrained(folder, output_loading_info=True)
            self.assertEqual(info["missing_keys"], set())


def test_mixins_found_the_model() -> None:
    """Guards the glue: with the names missing, most mixin tests would silently test less."""
    assert modeling_auto.MODEL_MAPPING_NAMES["vaswani"] == "VaswaniModel"
    assert modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES["vaswani"] == "VaswaniForConditionalGeneration"
