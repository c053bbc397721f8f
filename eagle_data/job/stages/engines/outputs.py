"""The columns of the engine stage's output: those of Ray's vLLM stage, which the
transformers backend emits too."""

ENGINE_ERROR_COLUMN = "__inference_error__"  # a row's engine error text, "" on success
# Ray 2.60's `vLLMOutputData` fields with the values a failed row gets (a test compares them).
VLLM_OUTPUT_DEFAULTS = {"prompt": "", "prompt_token_ids": None, "num_input_tokens": 0, "generated_tokens": [],
                        "generated_text": "", "num_generated_tokens": 0, "embeddings": None, "metrics": None,
                        "logprobs": None, "prompt_logprobs": None}
# And the bookkeeping columns Ray's vLLM stage adds to every row besides them.
VLLM_STAGE_EXTRA_COLUMNS = ("request_id", "params", "time_taken_llm", "batch_uuid")
CONSUMED = ("tokenized_prompt", "sampling_params")  # popped by the engine, as Ray's stage does


def engine_output(prompt: list[int] | None = None, generated: list[int] = (), error: str = "") -> dict:
    """One row as Ray's vLLM stage emits it; an error row gets the values that stage gives."""
    return {**VLLM_OUTPUT_DEFAULTS, "prompt_token_ids": prompt, "num_input_tokens": len(prompt or ()),
            "generated_tokens": list(generated), "num_generated_tokens": len(generated), ENGINE_ERROR_COLUMN: error}
