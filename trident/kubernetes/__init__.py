"""Kubernetes manifests for a Trident deployment (render.py; `trident kubernetes`)."""
