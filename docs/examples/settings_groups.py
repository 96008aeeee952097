from sparkhvd import HorovodRunner, LaunchConfig, RunConfig, ScalingConfig

by_keyword = HorovodRunner(np=2, output_dir="runs", start_timeout=60)      # keywords, or
by_group = HorovodRunner(scaling=ScalingConfig(np=2), launch=LaunchConfig(start_timeout=60),
                         run_config=RunConfig(output_dir="runs"))
assert by_keyword.scaling == by_group.scaling
assert by_keyword.launch_config == by_group.launch_config
assert by_keyword.run_config == by_group.run_config
