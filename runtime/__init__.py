"""mg.runtime: loads an artifact and serves it (caches, scheduler, DFlash, `mg-run`).

Knows the model only through the artifact: never imports mg.export.
"""
