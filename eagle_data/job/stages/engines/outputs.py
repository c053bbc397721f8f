"""The columns of the engine stage's output: those of Ray's vLLM stage, which the
transformers backend emits too."""

ENGINE_ERROR_COLUMN = "__inference_error__"  # a row's engine error text, "" on success
# Ray 2.60's `vLLMOutputData` fields with the values a failed row gets (a test compares them).
VLLM_OUTPUT_DEFAULTS = {"prompt": "", "prompt_token_ids": None, "num_input_tokens": 0, "generated_tokens": [],
                        "generated_text": "", "num_generated_tokens": 0, "embeddings": None, "metrics": None,
                        "logprobs": None, "prompt_logprobs": None}
# And the bookkeeping columns Ray's vLLM stage adds to every row besides them.
VLLM_STAGE_EXTRA_COLUMNS = ("request_id", "params", "time_taken_llm", "batch_uuid")
