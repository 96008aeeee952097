"""Shared by every side -- driver, Spark task, rank: the message protocol, the rank's identity and
environment rule, errors and redaction, process-tree control, network interfaces, the run-folder
wire format, the backends' rendezvous tables and every third-party patch.

Imports nothing else of sparkhvd and only the standard library at import time (third-party
libraries inside functions): a rank or a Spark task imports it for free.
"""
__side__ = "common"
