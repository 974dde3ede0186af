"""The encoder worker (`pagemesh encoder`, `pagemesh up --encoder N`): a multimodal model's
vision tower as a pool of its own, pushing image rows to the LLM workers that prefill."""
