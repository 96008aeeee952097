"""The executor side of the launchers (what runs inside Spark tasks), and the one rank-process
spawner shared with the local launcher. Imports nothing from the driver side."""
