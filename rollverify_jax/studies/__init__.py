"""Studies and reports over runs: each module is a CLI (``python -m rollverify_jax.studies.<name>``) that runs or
reads training runs, simulations or measurements and writes a table, plot or markdown report under docs/.

Nothing here is imported by training; modules that were JAX-free as scripts stay JAX-free (they read metrics
files, gin text or JSON), so a report can be rebuilt on a machine without an accelerator stack.
"""
