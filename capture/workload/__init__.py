"""The workload driver behind `kvscope run`: server, prompts, client, phases."""
