module ep_moe.dev/epmoe

go 1.19
