from humanline_cli.cli.main import main

main()
