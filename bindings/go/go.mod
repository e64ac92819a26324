module ep-moe.dev/epmoe

go 1.19
