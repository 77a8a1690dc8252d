"""geomtrain: Manifold Muon, a GPT-2 trainer with module-wise manifold assignment, and the study."""
