"""The diffusion worker: images through the mesh, batched at every denoising step."""
