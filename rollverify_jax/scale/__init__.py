"""Real scale without hardware: the deviceless compile of a run for a TPU slice, its memory and roofline
reports."""
