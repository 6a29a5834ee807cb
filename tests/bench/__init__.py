"""``ckptbench``'s subcommands (bench/), run on tiny inputs."""
