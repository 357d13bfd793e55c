from disagg_connector.router.cli import main

if __name__ == "__main__":
    main()
