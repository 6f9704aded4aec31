from fthsdp.cli.main import main

main()
