"""The OpenAI-compatible server: ``dsinfer serve``."""

# The name the embedded default model is served under when neither a checkpoint nor --served-model-name is given.
DEFAULT_SERVED_MODEL_NAME = "dsinfer-default-v41"
