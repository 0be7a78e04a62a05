"""hf_vaswani: the Transformer of "Attention Is All You Need" as a Hugging Face transformers model."""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from .decoding.search import generate
from .decoding.translation import Translator
from .interop import convert
from .kernels.cpu import kernelize
from .model.configuration_vaswani import VaswaniConfig
from .model.errors_vaswani import UsageError
from .model.modeling_vaswani import VaswaniForConditionalGeneration, VaswaniModel, VaswaniPreTrainedModel
from .model.pipeline_vaswani import TranslationPipeline

__version__ = "0.1.0"


def save_model_folder(model: VaswaniForConditionalGeneration, tokenizer, folder) -> None:
    """Save the model and its tokenizer into one folder that loads with the Auto classes, also by remote code.

    The model writes its weights, config, generation config and its code (modeling and the modules it imports, the
    translation pipeline among them); the tokenizer its files. The model card (README.md), which a Hub upload also
    needs, is written separately (`hf_vaswani.interop.model_card.write_model_card`).
    """
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


AutoConfig.register(VaswaniConfig.model_type, VaswaniConfig, exist_ok=True)
AutoModel.register(VaswaniConfig, VaswaniModel, exist_ok=True)
AutoModelForSeq2SeqLM.register(VaswaniConfig, VaswaniForConditionalGeneration, exist_ok=True)
# save_pretrained then writes `auto_map` and copies the two modeling files, so saved folders load with
# trust_remote_code=True where hf_vaswani is not installed.
VaswaniConfig.register_for_auto_class()
VaswaniModel.register_for_auto_class("AutoModel")
VaswaniForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")

__all__ = [
    "TranslationPipeline",
    "Translator",
    "UsageError",
    "VaswaniConfig",
    "VaswaniForConditionalGeneration",
    "VaswaniModel",
    "VaswaniPreTrainedModel",
    "convert",
    "generate",
    "kernelize",
    "save_model_folder",
]
