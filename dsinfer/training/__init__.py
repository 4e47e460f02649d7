"""Training the embedded default model: corpus, rendering, the training loop and the release-format export."""
