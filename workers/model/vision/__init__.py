"""Vision encoders of multimodal families: each turns preprocessed images into rows of the
language model's embedding space, loaded from a Hugging Face checkpoint's tensors."""
