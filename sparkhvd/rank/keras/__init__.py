"""The Keras helpers' implementation (public as :mod:`sparkhvd.keras`)."""
