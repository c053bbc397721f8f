"""The job's phases, in the order they run (each reads what the ones before it wrote)."""

from eagle_data.job.phases import generate, hidden_states, prompts

PHASES = (prompts.PHASE, generate.PHASE, hidden_states.PHASE)
PHASE_BY_NAME = {phase.name: phase for phase in PHASES}
