"""Private names of other libraries this package relies on: each test fails naming the name when a release moves it."""

import inspect

import pytest
import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedConfig, PreTrainedModel

from hf_vaswani.model.generation_vaswani import PaperDecodingMixin

# The private GenerationMixin methods that generation_vaswani.PaperDecodingMixin overrides, each with the parameters
# its override takes or passes by keyword. transformers' generate calls them as `self.<name>(...)`.
GENERATION_HOOKS: dict[str, tuple[str, ...]] = {
    "_get_logits_processor": (),  # all handed on as given
    "_expand_inputs_for_generation": ("expand_size", "is_encoder_decoder"),
    "_reorder_cache": (),  # looked up by beam search with hasattr: GenerationMixin itself has none
    "_update_finished_beams": ("cur_len", "decoder_prompt_len", "length_penalty"),
    "_check_early_stop_heuristic": ("cur_len", "max_length", "decoder_prompt_len", "early_stopping", "length_penalty"),
}


def test_every_private_generation_method_overridden_is_listed() -> None:
    ours = {name for name in vars(PaperDecodingMixin) if name.startswith("_") and not name.startswith("__")}
    overridden = {name for name in ours if hasattr(GenerationMixin, name)} | {"_reorder_cache"}
    assert overridden == set(GENERATION_HOOKS), "GENERATION_HOOKS must list every override of PaperDecodingMixin"


@pytest.mark.parametrize("name", GENERATION_HOOKS)
def test_generation_hook_is_called_with_the_parameters_the_override_relies_on(name: str) -> None:
    called_by = inspect.getsource(GenerationMixin)
    assert f"self.{name}(" in called_by, f"transformers' GenerationMixin no longer calls {name}: the override is dead"
    if name == "_reorder_cache":
        return
    method = getattr(GenerationMixin, name, None)
    assert method is not None, f"GenerationMixin.{name} is gone"
    missing = [p for p in GENERATION_HOOKS[name] if p not in inspect.signature(method).parameters]
    assert not missing, f"GenerationMixin.{name} lost the parameters {missing}"


def test_expand_inputs_for_generation_takes_expand_size_and_is_encoder_decoder_first_then_the_model_inputs() -> None:
    """The override hands the two on by position and reads the encoder outputs, mask and cache among the rest."""
    parameters = inspect.signature(GenerationMixin._expand_inputs_for_generation).parameters
    names, kinds = list(parameters), [parameter.kind for parameter in parameters.values()]
    assert names[1:3] == ["expand_size", "is_encoder_decoder"] and kinds[-1] is inspect.Parameter.VAR_KEYWORD, (
        f"GenerationMixin._expand_inputs_for_generation takes {names}"
    )


def test_generation_config_get_default_generation_params() -> None:
    """configuration_vaswani accepts the keys it lists, which PreTrainedConfig drops from a model config."""
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    assert defaults is not None, "GenerationConfig._get_default_generation_params is gone"
    keys = defaults()
    assert isinstance(keys, dict) and {"num_beams", "length_penalty", "max_length"} <= keys.keys(), (
        f"GenerationConfig._get_default_generation_params returns {keys!r}"
    )


def test_pretrained_config_attn_implementation() -> None:
    """modeling_vaswani picks the attention function by it, as transformers' own models do."""
    config = PreTrainedConfig(attn_implementation="eager")
    assert getattr(config, "_attn_implementation", None) == "eager", "PreTrainedConfig._attn_implementation moved"


def test_generation_config_from_model_config() -> None:
    """convert.py clears it so that a converted model's generation config keeps its non-standard keys on reload."""
    config = GenerationConfig(_from_model_config=True)
    assert getattr(config, "_from_model_config", None) is True, "GenerationConfig._from_model_config moved"


@pytest.mark.parametrize(
    "namespace, name",
    [
        ("mkl", "_mkl_reorder_linear_weight"),
        ("mkl", "_mkl_linear"),
        ("mkldnn", "_reorder_linear_weight"),
        ("mkldnn", "_linear_pointwise"),
    ],
)
def test_torch_cpu_ops_of_the_cpu_kernels(namespace: str, name: str) -> None:
    """kernels/cpu.py (package-only code, never remote code) packs and multiplies weights with these operators."""
    backend = {"mkl": torch.backends.mkl, "mkldnn": torch.backends.mkldnn}[namespace]
    if not backend.is_available():
        pytest.skip(f"this torch build has no {namespace}")
    assert hasattr(getattr(torch.ops, namespace), name), f"torch.ops.{namespace}.{name} is gone"


@pytest.mark.parametrize("name", ["linear_prepack", "linear_dynamic"])
def test_torch_quantized_ops_of_the_shortlists_int8_projection(name: str) -> None:
    """decoding/search.py packs and multiplies an int8 output projection narrowed to a shortlist with these."""
    assert hasattr(torch.ops.quantized, name), f"torch.ops.quantized.{name} is gone"


def test_huggingface_hub_http_error_is_its_clients_error_base() -> None:
    """`vaswani push` catches huggingface_hub.errors.HTTPError for connection failures, which are not OSErrors."""
    from huggingface_hub import errors

    base = getattr(errors, "HTTPError", None)
    assert isinstance(base, type), "huggingface_hub.errors.HTTPError is gone"
    assert issubclass(errors.HfHubHTTPError, base), "huggingface_hub.errors.HTTPError is no longer its errors' base"


def test_generation_mixin_prepare_generation_config() -> None:
    """The package's search resolves a call's settings with it, as transformers' generate does: the given config,
    then the model's, then the defaults, the call's arguments last, the rest handed back as model arguments."""
    from tiny import TINY_MODEL, random_model

    model = random_model(0, TINY_MODEL)
    prepare = getattr(model, "_prepare_generation_config", None)
    assert prepare is not None, "GenerationMixin._prepare_generation_config is gone"
    assert "_prepare_generation_config(" in inspect.getsource(GenerationMixin.generate), (
        "transformers' generate no longer calls _prepare_generation_config"
    )
    model.generation_config.num_beams = 3
    config, arguments = prepare(GenerationConfig(length_penalty=0.5), max_new_tokens=7, attention_mask="mask")
    assert (config.num_beams, config.length_penalty, config.max_new_tokens) == (3, 0.5, 7)
    assert arguments == {"attention_mask": "mask"}, f"_prepare_generation_config hands back {arguments}"


def test_ctranslate2_converter_load() -> None:
    """export.py converts an in-memory model by overriding CTranslate2's Converter._load, which its convert calls."""
    converter = pytest.importorskip("ctranslate2.converters.converter")
    assert "_load" in vars(converter.Converter), "ctranslate2's Converter no longer defines _load"
    assert "self._load(" in inspect.getsource(converter.Converter.convert), "Converter.convert no longer calls _load"


def test_accelerate_batch_sampler_shard_fields() -> None:
    """trainer.py makes accelerate's BatchSamplerShard hand on the batches of a sampler that shards by itself, by
    setting its num_processes and process_index, which its iteration reads, and finds the sampler as batch_sampler."""
    from accelerate.data_loader import BatchSamplerShard

    source = inspect.getsource(BatchSamplerShard)
    for field in ("num_processes", "process_index", "batch_sampler"):
        assert f"self.{field}" in source, f"accelerate's BatchSamplerShard no longer has {field}"
    sampler = [[0, 1], [2, 3], [4, 5], [6, 7]]
    shard = BatchSamplerShard(sampler, num_processes=2, process_index=1)
    assert shard.batch_sampler is sampler
    shard.num_processes, shard.process_index = 1, 0
    assert list(shard) == sampler, "setting num_processes and process_index no longer turns sharding off"


def test_trainer_load_optimizer_and_scheduler() -> None:
    """VaswaniTrainer gives the optimizer its state before Trainer loads a checkpoint's into it, by overriding this
    hook, which Trainer's training loop calls with the checkpoint to resume from."""
    from transformers import Trainer

    hook = getattr(Trainer, "_load_optimizer_and_scheduler", None)
    assert hook is not None, "Trainer._load_optimizer_and_scheduler is gone"
    assert list(inspect.signature(hook).parameters) == ["self", "checkpoint"]
    assert "self._load_optimizer_and_scheduler(" in inspect.getsource(Trainer), "Trainer no longer calls the hook"


def test_trainer_save() -> None:
    """VaswaniTrainer saves a model FSDP2 wrapped with the code of the class it wrapped by overriding this hook, through
    which Trainer's save_model saves every model, given the folder and, under FSDP, the state dict."""
    from transformers import Trainer

    hook = getattr(Trainer, "_save", None)
    assert hook is not None, "Trainer._save is gone"
    assert list(inspect.signature(hook).parameters) == ["self", "output_dir", "state_dict"]
    assert "self._save(output_dir, state_dict=state_dict)" in inspect.getsource(Trainer.save_model), (
        "Trainer.save_model no longer saves through _save"
    )
    # and it keeps save_pretrained from saving the code of FSDP2's class by the class attribute that says to save any
    assert "_auto_class" in vars(PreTrainedModel), "PreTrainedModel._auto_class is gone"
    assert "cls._auto_class is not None" in inspect.getsource(PreTrainedModel.is_remote_code)
    assert "self.is_remote_code()" in inspect.getsource(PreTrainedModel.save_pretrained)


def test_accelerate_fsdp2_prepare_model_groups_the_input_and_output_embeddings_when_tied() -> None:
    """FSDP2 through accelerate puts the shared embedding's every use in one group because fsdp2_prepare_model puts
    get_input_embeddings() in one fully_shard group with get_output_embeddings() when their weights are one, and the
    model's source and target embeddings are one module (modeling_vaswani's tie_weights). Were accelerate to group
    otherwise, the decoder's use would land in another group, which FSDP2 refuses at the first step."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    source = inspect.getsource(fsdp2_prepare_model)
    for read in ("get_input_embeddings", "get_output_embeddings", "input_weight is output_weight"):
        assert read in source, f"accelerate's fsdp2_prepare_model no longer groups by {read}"


def test_accelerate_save_fsdp_model_writes_sharded_weights_where_the_package_reads_them() -> None:
    """sharded_weights.py reads a checkpoint's sharded weights from accelerate's folder FSDP_MODEL_NAME_0, saved
    as {"model": state_dict} (so named "model.<name>" in the distributed checkpoint)."""
    from accelerate.utils.fsdp_utils import save_fsdp_model

    source = inspect.getsource(save_fsdp_model)
    assert 'f"{FSDP_MODEL_NAME}_{model_index}"' in source, "accelerate's save_fsdp_model writes elsewhere"
    assert 'state_dict={"model": state_dict}' in source, "accelerate's save_fsdp_model names the weights otherwise"
