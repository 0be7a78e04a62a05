"""A "translation" pipeline for sequence-to-sequence models (transformers 5 dropped its own).

Saved with every VaswaniForConditionalGeneration (`custom_pipelines` in config.json), it makes
`pipeline("translation", model=folder_or_repo, trust_remote_code=True)` work. This file travels to the Hub with
`trust_remote_code`: it imports only transformers.
"""

from transformers import Pipeline

from .errors_vaswani import UsageError

# The `custom_pipelines` entry of config.json that points transformers' `pipeline` at this file.
TRANSLATION_PIPELINE = {
    "translation": {"impl": "pipeline_vaswani.TranslationPipeline", "pt": ["AutoModelForSeq2SeqLM"]}
}


class TranslationPipeline(Pipeline):
    """Text in, `[{"translation_text": ...}]` out, decoded with the model's generation config or `generate_kwargs`."""

    _load_tokenizer = True

    def __call__(self, inputs: str | list[str], **kwargs):
        results = super().__call__(inputs, **kwargs)
        # As transformers 4's pipeline: one dict per input sentence unless several sequences were asked for.
        if isinstance(inputs, list) and all(len(result) == 1 for result in results):
            return [result[0] for result in results]
        return results

    def _sanitize_parameters(self, generate_kwargs: dict | None = None, **kwargs) -> tuple[dict, dict, dict]:
        forward = dict(generate_kwargs or {})
        for name in ("max_new_tokens", "num_beams", "length_penalty", "do_sample", "num_return_sequences"):
            if name in kwargs:
                forward[name] = kwargs.pop(name)
        if kwargs:
            raise UsageError(f"unknown translation pipeline arguments: {sorted(kwargs)}")
        return {}, {"generate_kwargs": forward}, {}

    def preprocess(self, text: str) -> dict:
        if not isinstance(text, str):
            raise UsageError(f"the translation pipeline takes strings, got {type(text).__name__}")
        return self.tokenizer(text, return_tensors="pt")

    def _forward(self, model_inputs: dict, generate_kwargs: dict) -> dict:
        return {"output_ids": self.model.generate(**model_inputs, **generate_kwargs)}

    def postprocess(self, model_outputs: dict) -> list[dict[str, str]]:
        texts = self.tokenizer.batch_decode(model_outputs["output_ids"], skip_special_tokens=True)
        return [{"translation_text": text} for text in texts]
