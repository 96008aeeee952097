"""Runnable examples (digits) shared by the demo, jobs/ and notebooks/."""
__side__ = "public"
