"""mg.export: MG model definitions, checkpoint loading, lowering to ExecuTorch, and `mg-export`.

Imports mg.manifests and mg.kernels; the runtime never imports this package.
"""
