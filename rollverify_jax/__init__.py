"""rollverify_jax."""
