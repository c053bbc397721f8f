"""For benchmarks/one_pass.py only: the project's hidden-states connector, loaded by vLLM's
engine processes by name (`kv_connector_module_path`), with vLLM's `extract_hidden_states`
method corrected as vllm-project/vllm#56442 proposes for #56417 (open in vLLM 0.29).

The method's `prepare_next_token_ids_padded` continues every request from column 0 of the
step's sampled tokens. When the step's one draft token was accepted, the row holds two tokens
(the draft and the bonus token) and the engine continues from the first; vLLM's issue reports
repeated tokens. The PR's fix is the base proposer's method (the last valid token of each row,
and their count); here the method is taken from it. Measured with it (docs/performance.md,
section 12), the one-pass answers repeat tokens as often as without it."""

from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from eagle_data.job.stages.engines.hidden_states_connector import HiddenStatesConnector

__all__ = ["HiddenStatesConnector"]  # the class vLLM loads from this module

ExtractHiddenStatesProposer.prepare_next_token_ids_padded = SpecDecodeBaseProposer.prepare_next_token_ids_padded
